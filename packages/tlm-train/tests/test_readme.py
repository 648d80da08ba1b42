"""The README's custom loop (the lead quotes it): it must run as written, and learn."""

import numpy as np


def test_custom_loop_from_the_public_parts(tmp_path) -> None:
    out = tmp_path / "ckpt"
    # --- the README example, verbatim from here --------------------------------------------
    import torch

    from tlm_model import TransformerLM
    from tlm_optim import AdamW, CosineSchedule
    from tlm_train import (
        BatchSampler,
        CheckpointManager,
        EvalBatches,
        LanguageModelLoss,
        capture_state,
        evaluate_loss,
        train_step,
    )

    tokens = np.tile(np.arange(64, dtype=np.uint16), 200)  # any 1-D token array or np.memmap
    train, val = tokens[:11_000], tokens[11_000:]
    model = TransformerLM(
        ModelConfig(vocab_size=64, context_length=32, d_model=64, num_layers=2, num_heads=2, d_ff=128)
    )
    loss_fn = LanguageModelLoss(model)  # wrap this in DDP / fully_shard to scale out
    optimizer = AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    schedule = CosineSchedule(optimizer, 3e-3, 3e-4, warmup_iters=5, cosine_cycle_iters=60)
    sampler = BatchSampler(train, batch_size=8, context_length=32, seed=0)
    checkpoints = CheckpointManager(out, keep=2)
    for step in range(1, 61):
        stats = train_step(loss_fn, optimizer, [next(sampler)], scheduler=schedule, max_grad_norm=1.0)
        if step % 20 == 0:
            val_loss = evaluate_loss(loss_fn, EvalBatches(val, 8, 32, max_batches=4))
            print(f"step {step}: train {stats.loss:.3f}, val {val_loss:.3f}, lr {stats.lr:.1e}")
            checkpoints.save(capture_state(model, optimizer, step=step, scheduler=schedule, sampler=sampler))
    # --- end of the example ----------------------------------------------------------------
    assert val_loss < 0.5 * float(torch.log(torch.tensor(64.0)))
    assert checkpoints.steps() == [40, 60]
