"""stats.log_once: a message (or a key) is logged once per process."""

import logging
import uuid

from dualkv_compile.stats import log_once


def test_log_once_logs_a_key_once(caplog):
    log = logging.getLogger("dualkv_compile.test_log_once")
    tag = uuid.uuid4().hex  # the record of keys is process-wide
    with caplog.at_level(logging.WARNING, logger=log.name):
        for value in (1, 2, 3):
            log_once(log, logging.WARNING, f"{tag} value {value}", key=tag)
        log_once(log, logging.WARNING, f"{tag} plain")
        log_once(log, logging.WARNING, f"{tag} plain")
    messages = [r.getMessage() for r in caplog.records if tag in r.getMessage()]
    assert messages == [f"{tag} value 1", f"{tag} plain"]
