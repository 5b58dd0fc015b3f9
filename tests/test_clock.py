"""The phase clock (systems.clock): what a rank's step phases record, without processes."""
import time

import pytest

from systems.base import StepOutput
from systems.clock import PhaseClock, _runqueue_s, parse_schedstat


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_phase_inside_another_pauses_it_and_sleep_is_wall_without_cpu():
    clock = PhaseClock()
    with clock.phase("compute"):
        _spin(0.02)
        with clock.phase("grad_sync"):           # Megatron's reduction inside its schedule
            time.sleep(0.05)
        _spin(0.02)
    with clock.phase("optimizer"):
        _spin(0.01)
    wall, cpu = clock.wall_s, clock.cpu_s
    assert cpu["compute"] >= 0.04 and cpu["optimizer"] >= 0.01
    assert wall["grad_sync"] >= 0.05 and cpu["grad_sync"] < 0.01     # asleep: off the CPU, not queued
    queued = clock.runqueue_s or dict.fromkeys(wall, 0.0)      # no schedstats: none counted
    # the sleep is the inner phase's alone: the outer one slept at most a little of it
    assert wall["compute"] - cpu["compute"] - queued["compute"] < 0.025, (wall, cpu, queued)
    for phase in wall:
        assert 0 <= queued[phase] and cpu[phase] + queued[phase] <= wall[phase] + 0.002, (phase, wall, cpu, queued)


def test_a_helper_threads_work_shows_in_the_process_cpu_alone():
    import threading
    clock = PhaseClock()
    with clock.phase("optimizer"):
        helper = threading.Thread(target=_spin, args=(0.05,))     # gloo's thread copying a bucket
        helper.start()
        helper.join()
    # the training thread slept in join(); the helper's 0.05 s of CPU is the process's
    assert clock.cpu_s["optimizer"] < 0.02 and clock.process_cpu_s["optimizer"] >= 0.045


def test_the_clock_hands_its_phases_to_the_step_output():
    clock = PhaseClock()
    with clock.phase("optimizer"):
        _spin(0.005)
    out = clock.fill(StepOutput())
    assert set(out.phase_s) == set(out.phase_cpu_s) == set(out.phase_process_cpu_s) == {"compute", "grad_sync",
                                                                                        "optimizer"}
    # all threads' CPU holds the training thread's (the two clocks differ by microseconds)
    assert out.phase_process_cpu_s["optimizer"] >= out.phase_cpu_s["optimizer"] - 1e-4
    assert out.phase_s["compute"] == 0.0 and out.phase_cpu_s["optimizer"] > 0
    # Linux reports each thread's runqueue; elsewhere the field stays empty
    assert (set(out.phase_runqueue_s) == set(out.phase_s)) == (_runqueue_s() is not None)


def test_an_unknown_phase_is_refused():
    with pytest.raises(ValueError, match="unknown step phase 'backward'"):
        with PhaseClock().phase("backward"):
            pass


def test_a_schedstat_line_reads_as_seconds():
    assert parse_schedstat("328144918 32808 8\n") == (0.328144918, 0.000032808)
    assert parse_schedstat("") is None
