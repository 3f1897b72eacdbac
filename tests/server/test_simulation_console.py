"""The simulation engine's console: Flower's run_simulation banner and Ray's default-change tip
are dropped, nothing else (server/simulation.py)."""

from __future__ import annotations

import logging
import warnings

from flwr.common.logger import warn_deprecated_feature

from server.simulation import _quiet_run_simulation


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(record.getMessage())


def test_only_the_banner_and_the_tip_are_dropped():
    handler = _Records()
    flwr_logger = logging.getLogger("flwr")
    flwr_logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with _quiet_run_simulation():
                warn_deprecated_feature("The `run_simulation` function is deprecated and will be removed")
                warn_deprecated_feature("Passing `enable_tf_gpu_growth` is deprecated")
                flwr_logger.warning("a client failed")
                tip = "Tip: In future versions of Ray, Ray will no longer override"
                warnings.warn(tip, FutureWarning, stacklevel=1)
                warnings.warn("something else", FutureWarning, stacklevel=1)
        warn_deprecated_feature("The `run_simulation` function is deprecated, outside the call")
    finally:
        flwr_logger.removeHandler(handler)
    assert not any("`run_simulation` function is deprecated and will" in m for m in handler.seen)
    assert any("enable_tf_gpu_growth" in m for m in handler.seen)
    assert "a client failed" in handler.seen
    assert any("outside the call" in m for m in handler.seen)
    assert [str(w.message) for w in caught] == ["something else"]
