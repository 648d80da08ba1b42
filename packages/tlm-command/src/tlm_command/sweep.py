"""``tlm sweep``: tlm_experiments.sweep's runner on the command line; each flag a field of ``SweepOptions``."""

import argparse
import dataclasses
from typing import Any

from tlm_command.args import add_command, positive_int
from tlm_command.compare import add_result_arguments
from tlm_experiments import sweep


def add_parser(commands: Any) -> None:
    what = "train a grid or a list of runs into one folder (resumable), with a summary and plots"
    parser = add_command(commands, "sweep", what, sweep.__doc__)
    parser.add_argument("--out-dir", metavar="SWEEP", help="the sweep folder (new, or empty)")
    parser.add_argument("--resume", metavar="SWEEP", help="continue a sweep: finished runs are kept")
    parser.add_argument(
        "--grid", action="append", default=[], metavar="KEY=V1,V2,...", help="one setting's values (several: product)"
    )
    parser.add_argument("--runs", metavar="FILE.toml", help="named runs: [base] and one [runs.NAME] table per run")
    parser.add_argument("--config", metavar="FILE.toml", help="base settings, as tlm train --config reads them")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a base setting for every run")
    parser.add_argument(
        "--seeds", type=positive_int, default=None, metavar="N", help="run every setting N times, seeds SEED..SEED+N-1"
    )
    add_result_arguments(parser)
    parser.add_argument(
        "--jobs", type=positive_int, default=None, help="runs at once (default: one per CPU thread on the CPU, else 1)"
    )
    parser.add_argument(
        "--max-runs",
        type=positive_int,
        default=sweep.MAX_RUNS,
        help="refuse a plan of more runs than this (its size said)",
    )
    parser.add_argument("--quiet", action="store_true", help="no log lines")
    cluster = parser.add_argument_group("on a SLURM cluster (--launcher slurm: each run a task of one job array)")
    cluster.add_argument(
        "--launcher",
        choices=sweep.LAUNCHERS,
        default=None,
        help="where the runs train (default: local, or as the sweep was)",
    )
    cluster.add_argument("--partition", default=None, help="the SLURM partition (default: the cluster's default)")
    cluster.add_argument("--time", type=positive_int, default=None, metavar="MINUTES", help="task time limit (60)")
    cluster.add_argument("--cpus-per-task", type=positive_int, default=None, metavar="N", help="CPUs of each task (1)")
    cluster.add_argument("--gpus", type=positive_int, default=None, metavar="N", help="GPUs of each task (none)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    return sweep.run(
        sweep.SweepOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(sweep.SweepOptions)})
    )
