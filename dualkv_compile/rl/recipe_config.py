"""Strict configuration for the GRPO recipe: every key of the YAML file and of the command-line
overrides is checked against the recipe's schema before anything runs.

An unknown or misspelled key is reported with the closest known key and where it came from (the
file or the override); a value of the wrong type or outside its range gets one line naming it.
Component sections (`model`, `task`, ...) are checked against the signature of their
`_component_` where it names its parameters.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Callable

from .component_types import import_component, parameter_kinds
from .recipe_schema import (GRPO_SCHEMA, NULLABLE_SECTIONS, SUPPLIED_BY_RECIPE, Key, not_nan,
                            world_size)

__all__ = ["ConfigError", "GRPO_SCHEMA", "check_recipe_config", "instantiate_checked",
           "parse_checked", "split_problem"]


class ConfigError(ValueError):
    """One or more problems in a recipe config; `problems` holds one line each."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


def _type_ok(key: Key, value) -> bool:
    if key.kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if key.kind == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if key.kind == "bool":
        return isinstance(value, bool)
    if key.kind == "str":
        return isinstance(value, str)
    if key.kind == "choice":
        return value in key.choices
    return True


def _expected(key: Key) -> str:
    if key.kind == "choice":
        return f"one of {list(key.choices)}"
    return {"int": "an integer", "float": "a number", "bool": "true or false",
            "str": "a string"}[key.kind] + (" or null" if key.nullable else "")


class _Checker:
    def __init__(self, where: Callable[[str], str]):
        self.where, self.problems, self.warnings = where, [], []

    def bad(self, path: str, message: str):
        self.problems.append(f"{path} ({self.where(path)}): {message}")

    def unknown(self, path: str, known, *, warn: bool = False):
        leaf = path.rsplit(".", 1)[-1]
        close = difflib.get_close_matches(leaf, list(known), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {sorted(known)}"
        if warn:
            self.warnings.append(f"{path} ({self.where(path)}): not a named parameter of its "
                                 f"_component_, which passes it on as **kwargs (or drops it)"
                                 f"{hint}")
        else:
            self.bad(path, f"unknown key{hint}")

    def section(self, prefix: str, schema: dict, values: dict):
        for name, value in values.items():
            path = f"{prefix}{name}"
            if name not in schema:
                self.unknown(path, schema)
                continue
            spec = schema[name]
            if isinstance(spec, dict):
                if value is None and name in NULLABLE_SECTIONS:
                    continue
                if not isinstance(value, dict):
                    self.bad(path, f"must be a section of {sorted(spec)}, got {value!r}")
                    continue
                self.section(path + ".", spec, value)
            elif spec.kind == "section":
                if value is not None or not spec.nullable:
                    self.component(path, value)
            else:
                self.value(path, spec, value)
        for name, spec in schema.items():
            required = spec.required if isinstance(spec, Key) else name not in NULLABLE_SECTIONS
            if required and name not in values:
                self.bad(f"{prefix}{name}", "missing")

    def value(self, path: str, key: Key, value):
        if value is None:
            if not key.nullable:
                self.bad(path, f"is null; expected {_expected(key)}")
            return
        if not _type_ok(key, value):
            self.bad(path, f"{value!r} is not {_expected(key)}")
            return
        problem = key.check(value) if key.check else None
        if problem:
            self.bad(path, f"{value!r} {problem}")

    def component(self, path: str, value):
        if not isinstance(value, dict) or "_component_" not in value:
            self.bad(path, f"must be a section with a _component_, got {value!r}")
            return
        try:
            target = import_component(value["_component_"])
        except Exception as e:  # noqa: BLE001 - reported as a config problem
            self.bad(f"{path}._component_", f"{value['_component_']!r} cannot be imported "
                                             f"({type(e).__name__}: {e})")
            return
        try:
            params = inspect.signature(target).parameters
        except (TypeError, ValueError):
            return
        # a component that takes **kwargs may use any key, or silently drop a misspelled one:
        # keys it does not name are warned about, not refused
        loose = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        known = {n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD
                 and p.kind is not inspect.Parameter.VAR_POSITIONAL} - SUPPLIED_BY_RECIPE.get(path, set())
        kinds = parameter_kinds(target)
        for name, given in value.items():
            if name != "_component_" and name not in known:
                self.unknown(f"{path}.{name}", known, warn=loose)
            elif name in kinds:  # annotated int, float, bool or str: held to it, and no NaN
                kind, nullable = kinds[name]
                self.value(f"{path}.{name}", Key(kind, not_nan if kind == "float" else None,
                                                 nullable=nullable), given)

    def across(self, config: dict):
        """Checks that involve several keys (each key's own range is checked already)."""
        overlong, gen = config.get("overlong"), config.get("max_generated_tokens")
        if isinstance(overlong, dict) and all(
                isinstance(overlong.get(k), int) for k in ("max_len", "cache_len")):
            top, cache = overlong["max_len"], overlong["cache_len"]
            if not 0 < cache <= top:
                self.bad("overlong.cache_len", f"{cache} must be in (0, overlong.max_len={top}]: "
                         "the penalty ramps over the last cache_len tokens before max_len")
            elif isinstance(gen, int) and top - cache >= gen:  # it is 0 up to top - cache tokens
                self.bad("overlong.max_len", f"{top} - overlong.cache_len={cache} must be < "
                         f"max_generated_tokens={gen}: the penalty starts past every response")
            elif isinstance(gen, int) and top > gen:  # DAPO's max_len is the generation budget
                self.warnings.append(f"overlong.max_len ({self.where('overlong.max_len')}): "
                                     f"{top} > max_generated_tokens={gen}: the longest "
                                     f"response's penalty is {(top - cache - gen) / cache:.3g}, "
                                     "not -1")
        loss = config.get("loss")
        width = loss.get("max_response_len") if isinstance(loss, dict) else None
        if isinstance(width, int) and isinstance(gen, int) and width < gen and loss.get(
                "aggregation") == "constant":  # GRPOLoss refuses wider responses mid-run
            self.bad("loss.max_response_len", f"{width} must be >= max_generated_tokens={gen}: "
                     "constant aggregation divides by it, and responses can be that long")
        model, checkpointer = config.get("model"), config.get("checkpointer")
        if isinstance(model, dict) and isinstance(checkpointer, dict):
            allowed = _over_config_json(model.get("_component_"))
            for key in sorted(set(model) - {"_component_", *allowed}):
                # one line per key, with where it came from; a near miss of an allowed key (no
                # Qwen3 builder's parameter is one) is a typo: the component check only warned
                close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
                if close:
                    self.bad(f"model.{key}", f"unknown key; did you mean {close[0]!r}? (with a "
                                             f"checkpointer the model section sets only "
                                             f"{', '.join(allowed[:-1])} and {allowed[-1]} over "
                                             f"the checkpoint's config.json)")
                    continue
                self.bad(f"model.{key}", "overrides the checkpoint's config.json, which the "
                                         "checkpointer copies into every saved folder "
                                         "(transformers would load another model); edit a copy "
                                         "of config.json and point checkpoint_dir at it instead")
        groups, micro = config.get("groups_per_step"), config.get("micro_batch_groups")
        ranks = world_size()  # set by torchrun (tune run --nproc...)
        if isinstance(groups, int) and isinstance(micro, int) and groups > 0 and micro > 0:
            updates = config.get("updates_per_step", 1)
            problem = split_problem(groups, ranks, micro,
                                    by_groups=config.get("max_tokens_per_micro_batch") is None,
                                    updates=updates if isinstance(updates, int) and updates > 0
                                    else 1)
            if problem:
                self.bad("groups_per_step", f"{groups} {problem}")


def _over_config_json(component) -> list[str]:
    """The model keys that may be set beside a checkpointer, over what its config.json holds:
    those the builder declares in `overrides_beside_checkpoint` (settings no saved weight or
    config depends on: the path, the sequence-length limit, an op choice), else these."""
    try:
        declared = getattr(import_component(component), "overrides_beside_checkpoint", None)
    except Exception:  # noqa: BLE001 - not importable: the component check names it
        declared = None
    return list(declared or ("path", "max_seq_len", "grouped_experts"))


def _dotted(values: dict, prefix: str = "") -> set[str]:
    out = set()
    for k, v in values.items():
        out.add(prefix + k)
        if isinstance(v, dict):
            out |= _dotted(v, prefix + k + ".")
    return out


def check_recipe_config(config: dict, *, config_file: str, overrides: list[str],
                        schema: dict | None = None) -> list[str]:
    """Raise ConfigError listing every problem of `config` (merged, resolved, plain containers);
    `overrides`: the command line's key=value strings, so each problem names where its key came
    from. Returns warnings: keys a **kwargs component does not name, an overlong band cut short."""
    overridden = {}
    for text in overrides:
        key = text.lstrip("~").split("=", 1)[0]
        overridden[key] = text
    from_file = _dotted(config)

    def where(path: str) -> str:
        for key in (path, *(path.rsplit(".", i)[0] for i in range(1, path.count(".") + 1))):
            if key in overridden:
                return f"command-line override {overridden[key]!r}"
        return config_file if path in from_file else f"required by the recipe, not in {config_file}"

    checker = _Checker(where)
    checker.section("", schema or GRPO_SCHEMA, config)
    if not checker.problems:
        checker.across(config)
    if checker.problems:
        raise ConfigError(checker.problems)
    return checker.warnings


def split_problem(groups_per_step: int, ranks: int, micro_batch_groups: int, *,
                  by_groups: bool, updates: int = 1) -> str | None:
    """What is wrong with splitting a step's groups over the ranks, their optimizer steps
    (updates_per_step mini-batches) and, micro-batching by whole groups, micro-batches of
    micro_batch_groups; or None."""
    per_rank, rest = divmod(groups_per_step, ranks)
    per_update, rest_update = divmod(per_rank, updates)
    if rest or rest_update or not per_update or (by_groups and per_update % micro_batch_groups):
        return (f"must split into {ranks} rank(s) x updates_per_step={updates} x whole "
                f"micro-batches of micro_batch_groups={micro_batch_groups}")
    return None


def instantiate_checked(section: str, target, *args, **kwargs):
    """torchtune's config.instantiate(target, *args, **kwargs), or target(*args, **kwargs) for
    a callable: a missing file or folder, or a value the component refuses (its TypeError or
    ValueError), becomes a ConfigError naming the config section."""
    try:
        if callable(target):
            return target(*args, **kwargs)
        from torchtune import config

        return config.instantiate(target, *args, **kwargs)
    except (FileNotFoundError, NotADirectoryError) as e:
        raise ConfigError([f"{section}: {e}"]) from None
    # a value the component refuses (lr=abc, embed_dim=63, betas=[0.9]: IndexError)
    except (TypeError, ValueError, IndexError) as e:
        raise ConfigError([f"{section}: {type(e).__name__}: {e}"]) from None


def _config_path(argv: list[str]) -> str:
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return "the config file"


def parse_checked(recipe_main: Callable, schema: dict | None = None) -> Callable:
    """torchtune's `config.parse` (YAML + key=value overrides into a DictConfig), then
    check_recipe_config; problems go to stderr, one line each, and the process exits 2."""
    import argparse
    import functools
    import sys

    @functools.wraps(recipe_main)
    def wrapper():
        from omegaconf import OmegaConf
        from torchtune.config._parse import TuneRecipeArgumentParser
        from torchtune.config._utils import _merge_yaml_and_cli_args

        parser = TuneRecipeArgumentParser(description=recipe_main.__doc__,
                                          formatter_class=argparse.RawDescriptionHelpFormatter)
        config_file = _config_path(sys.argv[1:])
        try:
            yaml_args, cli_args = parser.parse_known_args()
            conf = _merge_yaml_and_cli_args(yaml_args, cli_args)
            plain = OmegaConf.to_container(conf, resolve=True)
        except Exception as e:  # noqa: BLE001 - a malformed file or override, said in one line
            print(f"error: {config_file}: {type(e).__name__}: {e}", file=sys.stderr)
            sys.exit(2)
        try:
            for line in check_recipe_config(plain, config_file=config_file, overrides=cli_args,
                                            schema=schema):
                print(f"warning: {line}", file=sys.stderr)
        except ConfigError as e:
            for line in e.problems:
                print(f"error: {line}", file=sys.stderr)
            sys.exit(2)
        try:
            code = recipe_main(conf)
        except ConfigError as e:  # found while setting up (output_dir, checkpoint)
            for line in e.problems:
                print(f"error: {line}", file=sys.stderr)
            sys.exit(2)
        sys.exit(code)

    return wrapper
