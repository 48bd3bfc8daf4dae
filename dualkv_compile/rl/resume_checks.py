"""What a resumed run checks against its checkpoint: the file is this recipe's and has steps
left, the config changes nothing the saved weights and optimizer state depend on, and the model
built is the checkpoint's; the optimizer settings the config did change are applied."""

from __future__ import annotations

import inspect
from pathlib import Path

from .component_types import import_component
from .recipe_config import ConfigError

__all__ = ["CHECKPOINT_KEYS", "NOT_SET", "RESUME_FIXED", "SEEDS", "apply_config_changes",
           "check_resume_config", "check_resume_model", "config_changes", "load_checkpoint",
           "read_resume_checkpoint"]

CHECKPOINT_KEYS = ("model", "ref_model", "optimizer", "step", "task", "rngs")
# config keys (and sections) a resumed run must share with its checkpoint: the saved weights and
# optimizer state only fit these (a changed dtype would cast them, and the next save would
# replace the fp32 weights and moments with bf16 ones)
RESUME_FIXED = ("model", "tokenizer", "optimizer._component_", "dtype")
# keys that say how this run starts, expected to differ from the checkpoint's run: not listed
_RUN_CONTROL = ("resume_from_checkpoint", "overwrite_output_dir")
# seeds: a resumed run restores the generators they seeded, so changing them does nothing
SEEDS = ("seed", "task.seed")
# keys that name where files are, not what they hold
_LOCATIONS = ("path", "checkpoint_dir", "output_dir")


class _NotSet:
    def __repr__(self) -> str:
        return "not set"


NOT_SET = _NotSet()  # a key one of the two configs does not have


def config_changes(saved: dict | None, current: dict) -> dict[str, tuple]:
    """{dotted key: (checkpoint's value, current value)} for every leaf that differs between
    the config a checkpoint was written with and the current one ({} for a checkpoint that holds
    no config); NOT_SET for a key one side lacks. Not changes: a `_component_` named by another
    import path of the same object, and a key one side lacks that the other sets to its
    component's default."""
    if saved is None:
        return {}

    def leaves(d: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in d.items():
            out.update(leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
        return out

    old, new = leaves(saved), leaves(current)
    return {k: (old.get(k, NOT_SET), new.get(k, NOT_SET)) for k in sorted(old.keys() | new.keys())
            if old.get(k, NOT_SET) != new.get(k, NOT_SET) and k not in _RUN_CONTROL
            and not _same_setting(k, old, new)}


def _same_setting(key: str, old: dict, new: dict) -> bool:
    """Whether leaf `key`, different as text in the two configs (dotted leaves), means the same:
    a `_component_` that imports the same object, or a parameter of the model or tokenizer one
    side leaves out and the other sets to the default of the same component. (Not the
    optimizer's: the checkpoint's param groups hold the value its run used, which a key left
    out keeps, so a default stated now is a change to apply.)"""
    section, _, name = key.rpartition(".")
    if name == "_component_":
        a, b = (_component(d.get(key)) for d in (old, new))
        return a is not None and a is b
    if (key in old) == (key in new) or section.split(".")[0] not in ("model", "tokenizer"):
        return False
    target = _component(old.get(f"{section}._component_"))
    if target is None or target is not _component(new.get(f"{section}._component_")):
        return False
    try:
        default = inspect.signature(target).parameters[name].default
    except (KeyError, TypeError, ValueError):  # not a named parameter, or no signature
        return False
    value = new[key] if key in new else old[key]
    return default is not inspect.Parameter.empty and type(default) is type(value) \
        and default == value


def _component(path):
    """The object a `_component_` path names, or None."""
    if not isinstance(path, str):
        return None
    try:
        return import_component(path)
    except Exception:  # noqa: BLE001 - not importable: compared as text
        return None


def check_resume_config(path: Path, changes: dict[str, tuple]) -> None:
    """Raise ConfigError for changes to RESUME_FIXED keys, which the checkpoint cannot follow.
    A path may move (the same weights copied to another disk): paths are listed, not refused."""
    fixed = [k for k in changes if any(k == f or k.startswith(f + ".") for f in RESUME_FIXED)
             and k.rsplit(".", 1)[-1] not in _LOCATIONS]
    if fixed:
        raise ConfigError([f"{k}: {changes[k][0]!r} when {path} was written, {changes[k][1]!r} "
                           "now; a resumed run must keep it (start a new run in another "
                           "output_dir to change it)" for k in fixed])


# config.json fields that say nothing about the architecture (an exported epoch_N names its dtype)
_NOT_ARCHITECTURE = ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache")


def check_resume_model(path: Path, state: dict, shapes: dict[str, tuple],
                       model_config: dict | None) -> None:
    """The model built for a resumed run must be the checkpoint's: the same weight names and
    shapes, and, where it was built from a transformers config.json (`model_config`, kept in
    the checkpoint), the same architecture fields. A ConfigError lists what differs; a changed
    model.path or checkpoint_dir is a location, so only its contents are compared."""
    problems = []
    saved_config = state.get("model_config")
    if saved_config is not None and model_config is not None:
        keys = sorted((saved_config.keys() | model_config.keys()) - set(_NOT_ARCHITECTURE))
        problems += [f"the model's config.json {k}: {saved_config.get(k)!r} when {path} was "
                     f"written, {model_config.get(k)!r} now"
                     for k in keys if saved_config.get(k) != model_config.get(k)]
    saved = {k: tuple(v.shape) for k, v in state["model"].items()}
    differ = [k for k in sorted(saved.keys() | shapes.keys()) if saved.get(k) != shapes.get(k)]
    if differ:
        shown = "; ".join(f"{k} {saved.get(k, 'absent')} -> {shapes.get(k, 'absent')}"
                          for k in differ[:3])
        problems.append(f"the model's weights differ from {path}'s in {len(differ)} tensor(s): "
                        f"{shown}")
    if problems:
        raise ConfigError([*problems, "a resumed run must build the checkpoint's model (start a "
                                      "new run in another output_dir to change it)"])


def load_checkpoint(path: Path, *, num_steps: int) -> dict:
    """The recipe's checkpoint at `path`, or a ConfigError that names what is wrong with it
    (missing, unreadable, not this recipe's, already at num_steps). The file is never changed."""
    import torch

    if not path.is_file():
        raise ConfigError([f"resume_from_checkpoint=true but {path} does not exist"])
    try:
        state = torch.load(path, weights_only=True, mmap=True)  # each rank maps, none copies
    except Exception as e:  # noqa: BLE001 - any failure to read means the same to the user
        raise ConfigError([f"{path} is not a readable checkpoint ({type(e).__name__}: "
                           f"{str(e).splitlines()[0][:200]}); it was left untouched"]) from None
    missing = [k for k in CHECKPOINT_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise ConfigError([f"{path} is not a checkpoint of this recipe (no {missing}); it was "
                           "left untouched"])
    if state["step"] >= num_steps:
        raise ConfigError([f"num_steps={num_steps}: the checkpoint {path} is at step "
                           f"{state['step']} already, nothing is left to train; raise "
                           "num_steps to continue"])
    return state


def read_resume_checkpoint(path: Path, *, num_steps: int, world_size: int,
                           config: dict) -> tuple[dict, dict]:
    """load_checkpoint, then the checks a resumed run needs: the same number of ranks, and no
    change to RESUME_FIXED keys. Returns (state, config_changes)."""
    state = load_checkpoint(path, num_steps=num_steps)
    if len(state["rngs"]) != world_size:
        raise ConfigError([f"{path} was written by {len(state['rngs'])} rank(s); resume it with "
                           f"the same number, not {world_size}"])
    changes = config_changes(state.get("config"), config)
    check_resume_config(path, changes)
    return state, changes


def apply_config_changes(optimizer, changes: dict[str, tuple], *, step: int,
                         announce: bool) -> None:
    """After the checkpoint's optimizer state is loaded: set the hyperparameters the config
    changed since (optimizer.lr and the like) on every parameter group, which would otherwise
    keep the old ones; with `announce`, list every changed setting in one line."""
    if changes and announce:
        print(f"resuming step {step} with settings changed since it was saved (the config's "
              "optimizer settings replace the checkpoint's; one the config no longer sets keeps "
              "the checkpoint's): " + "; ".join(
                  f"{k}: {old!r} -> {new!r}" + (" (no effect: the checkpoint's random states "
                                                 "are restored)" if k in SEEDS else "")
                  for k, (old, new) in changes.items()), flush=True)
    for key, (_, value) in changes.items():
        section, _, name = key.partition(".")
        if section == "optimizer" and "." not in name and value not in (None, NOT_SET):
            for group in optimizer.param_groups:
                if name in group:
                    group[name] = value
