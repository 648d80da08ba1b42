"""SIGKILL a process that saves checkpoints in a loop, at random moments: the file on disk is
always a complete checkpoint, the last one reported saved or the one being written after it."""

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch import nn

from tlm_optim import AdamW
from tlm_train import load_checkpoint, save_checkpoint

CHILD = textwrap.dedent(
    """
    import sys
    import torch
    from torch import nn
    from tlm_optim import AdamW
    from tlm_train import save_checkpoint

    path, start = sys.argv[1], int(sys.argv[2])
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))  # 2.1M parameters: ~25 MB a save
    opt = AdamW(model.parameters())
    model(torch.ones(1, 1024)).sum().backward()
    opt.step()
    i = start
    while True:
        i += 1
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(i)
                opt.state[p]["exp_avg"].fill_(i)
        save_checkpoint(model, opt, i, path)
        print(i, flush=True)
    """
)

ROUNDS = 4


def _fresh():
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))
    return model, AdamW(model.parameters())


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="SIGKILL exists on POSIX systems only")
def test_sigkill_at_random_moments_leaves_old_or_new(tmp_path):
    script = tmp_path / "saver.py"
    script.write_text(CHILD)
    path = tmp_path / "ck.pt"
    rng = random.Random(20261130)
    last_seen = 0
    outcomes = []
    for _ in range(ROUNDS):
        child = subprocess.Popen(
            [sys.executable, str(script), str(path), str(last_seen)], stdout=subprocess.PIPE, text=True
        )
        try:
            reported = int(child.stdout.readline())  # one complete save, then a random moment
            time.sleep(rng.uniform(0.0, 0.4))
        finally:
            os.kill(child.pid, signal.SIGKILL)
            rest = child.communicate()[0]
        reported = max([reported, *(int(x) for x in rest.split())])
        model, opt = _fresh()
        iteration = load_checkpoint(path, model, opt)
        # Old (the last save reported complete) or new (the one in flight when killed).
        assert iteration in (reported, reported + 1)
        for p in model.parameters():
            assert torch.all(p == iteration) and torch.all(opt.state[p]["exp_avg"] == iteration)
        outcomes.append(iteration - reported)
        last_seen = iteration
    print(f"kills: {ROUNDS}, new checkpoint on disk after {sum(outcomes)}, old after {ROUNDS - sum(outcomes)}")
    leftovers = [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    # A killed save may leave its temporary file (nothing can remove it); never under the real name.
    assert all(n.startswith(".ck.pt.") for n in leftovers)
    # A save after the kills still works beside any leftovers.
    model, opt = _fresh()
    save_checkpoint(model, opt, last_seen + 1, path)
    assert load_checkpoint(path, *_fresh()) == last_seen + 1
