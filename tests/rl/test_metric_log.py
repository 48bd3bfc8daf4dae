"""rl.TensorBoardLogger: a resume continues its own output_dir's newest run, nobody else's."""

import re
import time

from omegaconf import OmegaConf
from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator

from dualkv_compile.rl import TensorBoardLogger
from dualkv_compile.rl.metric_log import open_metric_logger


def steps_and_values(run_dir):
    events = EventAccumulator(str(run_dir))
    events.Reload()
    return [(e.step, e.tensor_proto.float_val[0]) for e in events.Tensors("x")]


def test_resume_continues_its_own_run_when_another_shares_the_log_dir(tmp_path):
    log_dir = tmp_path / "logs"
    a = TensorBoardLogger(str(log_dir), output_dir=str(tmp_path / "a"))
    a.log_dict({"x": 1.0}, step=1)
    a.log_dict({"x": 2.0}, step=2)
    a.close()
    b = TensorBoardLogger(str(log_dir), output_dir=str(tmp_path / "b"))  # newer, another run
    b.log("x", 5.0, step=1)
    b.close()
    resumed = TensorBoardLogger(str(log_dir), output_dir=str(tmp_path / "a"))
    assert resumed.resume(1)
    assert resumed.run_dir == a.run_dir != b.run_dir
    resumed.log("x", 20.0, step=2)
    resumed.close()
    assert steps_and_values(a.run_dir) == [(1, 1.0), (2, 20.0)]  # step 2 as re-run, once
    assert steps_and_values(b.run_dir) == [(1, 5.0)]


def test_resume_without_an_earlier_run_starts_a_new_one(tmp_path):
    logger = TensorBoardLogger(str(tmp_path / "logs"), output_dir=str(tmp_path / "a"))
    assert not logger.resume(3)
    logger.log("x", 1.0, step=4)
    logger.close()
    assert steps_and_values(logger.run_dir) == [(4, 1.0)]


def test_a_run_whose_event_file_is_stamped_ahead_is_not_waited_for(tmp_path, capsys,
                                                                    monkeypatch):
    # the resume waited, silently and without bound, for the clock to pass the stamp of the
    # newest event file: one from a host whose clock ran an hour ahead stalled it an hour
    slept, sleep = [0.0], time.sleep

    def bounded_sleep(seconds):  # fails (in 10 s) where a wait would last the hour
        slept[0] += seconds
        assert slept[0] < 10, "the resume waits on"
        sleep(seconds)

    monkeypatch.setattr(time, "sleep", bounded_sleep)
    log_dir, out = tmp_path / "logs", tmp_path / "a"
    first = TensorBoardLogger(str(log_dir), output_dir=str(out))
    first.log("x", 1.0, step=1)
    first.close()
    ahead = int(time.time()) + 3600
    (first.run_dir / f"events.out.tfevents.{ahead}.otherhost.1.0").write_bytes(b"")
    cfg = OmegaConf.create({"_component_": "dualkv_compile.rl.TensorBoardLogger",
                            "log_dir": str(log_dir)})
    start = time.time()
    logger = open_metric_logger(cfg, OmegaConf.create({"a": 1}), output_dir=out, resume_step=1)
    assert time.time() - start < TensorBoardLogger.max_clock_wait_s
    logger.log("x", 2.0, step=2)
    logger.close()
    assert logger.run_dir != first.run_dir  # a new run, said once:
    said = capsys.readouterr().out
    assert said.count("metric_logger: a new run from step 2 (its newest event file in") == 1
    assert re.search(r"is stamped 3[56]\d\d s ahead of this clock, so this run's could not "
                     r"sort after it\): steps after 1", said), said


def test_a_stamp_a_few_seconds_ahead_is_waited_for_and_said(tmp_path, capsys):
    log_dir, out = tmp_path / "logs", tmp_path / "a"
    first = TensorBoardLogger(str(log_dir), output_dir=str(out))
    first.log("x", 1.0, step=1)
    first.close()
    (first.run_dir / f"events.out.tfevents.{int(time.time()) + 2}.otherhost.1.0").write_bytes(b"")
    resumed = TensorBoardLogger(str(log_dir), output_dir=str(out))
    assert resumed.resume(1) and resumed.run_dir == first.run_dir
    assert "metric_logger: waiting" in capsys.readouterr().out


def test_a_run_folder_named_ahead_of_the_clock_does_not_stay_the_newest(tmp_path):
    # run folders sorted by name (their UTC time): one made on a host whose clock ran ahead
    # stayed the newest, so every later resume picked it over the run made after it and
    # started yet another run
    log_dir, out = tmp_path / "logs", tmp_path / "a"
    ahead = TensorBoardLogger(str(log_dir), output_dir=str(out))
    ahead.log("x", 1.0, step=1)
    ahead.close()
    future = log_dir / "run_29990101-000000-000000000"
    ahead.run_dir.rename(future)
    (future / f"events.out.tfevents.{int(time.time()) + 3600}.otherhost.1.0").write_bytes(b"")
    second = TensorBoardLogger(str(log_dir), output_dir=str(out))
    assert not second.resume(1)  # stamped an hour ahead: a new run
    second.log("x", 2.0, step=2)
    second.close()
    third = TensorBoardLogger(str(log_dir), output_dir=str(out))
    assert third.resume(2) and third.run_dir == second.run_dir
