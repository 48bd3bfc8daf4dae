"""durable.sync: every file and folder of a folder written before a rename reaches the disk
(a sub-folder's entry too, or a power loss could drop the files listed in it)."""

import os

from dualkv_compile import durable


def test_sync_reaches_every_file_and_folder(tmp_path, monkeypatch):
    top = tmp_path / "ckpt.partial"
    (top / "sub" / "deeper").mkdir(parents=True)
    for f in ("a.json", "sub/b.bin", "sub/deeper/c.bin"):
        (top / f).write_bytes(b"x")
    synced, real = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")),
                                                 real(fd)))
    durable.sync(top)
    want = {top / "a.json", top / "sub" / "b.bin", top / "sub" / "deeper" / "c.bin",
            top / "sub", top / "sub" / "deeper", top}
    assert {os.path.realpath(p) for p in synced} == {os.path.realpath(p) for p in want}
