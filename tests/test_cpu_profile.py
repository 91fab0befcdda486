"""The CPU profile's pieces that are not the evaluate stage's: the training working resolution
and the expected training time logged at the start."""
from __future__ import annotations

import logging

import torch

from stages.reconstruct.data import CPU_WORKING_SIDE, working_side
from stages.reconstruct.telemetry import ExpectedTime


def test_working_side_caps_images_off_the_gpu_only():
    assert working_side(torch.device("cpu")) == CPU_WORKING_SIDE == 800
    assert working_side(torch.device("cuda", 0)) == 0


def test_expected_time_is_logged_once_after_the_probe_steps(caplog):
    with caplog.at_level(logging.INFO, logger="stages.reconstruct.telemetry"):
        probe = ExpectedTime(10, 110, torch.device("cpu"), probe=4)  # resumed at step 10 of 110
        for done in range(11, 30):
            probe.after(done)
        ExpectedTime(0, 6, torch.device("cpu"), probe=4).after(4)  # too short a run to be worth it
        ExpectedTime(0, 100, torch.device("cpu"), enabled=False, probe=4).after(4)  # not rank 0
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("expected: about")
    assert "for the 96 steps left" in lines[0] and "over steps 11..14" in lines[0]
