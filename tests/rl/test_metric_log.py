"""rl.TensorBoardLogger: a resume continues its own output_dir's newest run, nobody else's."""

from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator

from dualkv_compile.rl import TensorBoardLogger


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
