"""fit_threads: a busy machine gets fewer threads than cores, and the user's OMP_NUM_THREADS always wins."""

import pytest

from tlm_core.threads import THREADS_VARIABLE, ThreadChoice, fit_threads, usable_cpus


def test_an_idle_machine_keeps_every_thread_and_says_nothing():
    assert fit_threads(2, cpus=2, load=0.2, environ={}).threads == 2
    assert fit_threads(2, cpus=2, load=0.2, environ={}).note is None


@pytest.mark.parametrize(
    ("cpus", "load", "expected"),
    [(2, 1.0, 1), (2, 6.5, 1), (2, 0.6, 1), (16, 4.2, 12), (16, 15.6, 1), (8, 0.49, 8)],
)
def test_the_threads_are_the_cores_the_load_leaves_free(cpus, load, expected):
    # cpus - load, rounded to the nearest whole core, between 1 and the threads the process has.
    assert fit_threads(cpus, cpus=cpus, load=load, environ={}).threads == expected


def test_a_busy_machine_is_said_in_one_line_naming_the_count_and_what_to_set():
    choice = fit_threads(2, cpus=2, load=3.7, environ={})
    assert choice.threads == 1
    assert "\n" not in choice.note
    assert "load 3.7 on 2 CPUs" in choice.note and f"{THREADS_VARIABLE}=1" in choice.note
    assert "instead of 2" in choice.note


def test_omp_num_threads_set_is_kept_however_busy_the_machine():
    assert fit_threads(2, cpus=2, load=40.0, environ={THREADS_VARIABLE: "2"}) == fit_threads(2, load=0.0, environ={})
    assert fit_threads(2, cpus=2, load=40.0, environ={THREADS_VARIABLE: "2"}).note is None


def test_never_more_threads_than_the_process_has():
    assert fit_threads(1, cpus=8, load=0.0, environ={}).threads == 1


@pytest.mark.parametrize(
    ("kwargs", "name"), [({"current": 0}, "current"), ({"current": 2, "cpus": 0}, "cpus"),
                         ({"current": 2, "load": -1.0}, "load"), ({"current": True}, "current"),
                         ({"current": 2, "load": True}, "load")]
)  # fmt: skip
def test_bad_arguments_are_value_errors_naming_them(kwargs, name):
    current = kwargs.pop("current")
    with pytest.raises(ValueError, match=name):
        fit_threads(current, environ={}, **kwargs)


def test_without_a_load_given_the_systems_load_average_is_read(monkeypatch):
    import tlm_core.threads

    monkeypatch.setattr(tlm_core.threads, "load_average", lambda: 3.0)
    assert fit_threads(4, cpus=4, environ={}).threads == 1
    monkeypatch.setattr(tlm_core.threads, "load_average", lambda: None)  # no load average: the threads are kept
    assert fit_threads(4, cpus=4, environ={}).threads == 4


def test_without_an_environment_given_the_processs_own_is_read(monkeypatch):
    monkeypatch.setenv(THREADS_VARIABLE, "3")  # the user's choice, in os.environ: kept however busy
    assert fit_threads(4, cpus=4, load=9.0) == ThreadChoice(4)
    monkeypatch.delenv(THREADS_VARIABLE)
    assert fit_threads(4, cpus=4, load=9.0).threads == 1


@pytest.mark.parametrize(("mask", "expected"), [({0}, 1), ({0, 3, 5}, 3), (set(), 1)])
def test_the_usable_cpus_are_the_affinity_mask_and_at_least_one(monkeypatch, mask, expected):
    # os.sched_getaffinity (Linux) is the set of CPUs the process may run on: fewer than os.cpu_count() under
    # taskset, a container's cpuset or SLURM; at least one is counted whatever it says.
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: mask)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert usable_cpus() == expected


def test_a_choice_is_a_frozen_value():
    # Returned to callers that keep it: equal by value, hashable, and not changed after the fact.
    import dataclasses

    choice = fit_threads(2, cpus=2, load=0.0, environ={})
    assert choice == ThreadChoice(2) and hash(choice) == hash(ThreadChoice(2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        choice.threads = 8
