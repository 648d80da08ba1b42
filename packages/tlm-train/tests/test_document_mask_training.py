"""``document_mask``: the training and validation loss of a run see each packed document alone."""

import re

import numpy as np
import pytest

from tlm_model import ModelConfig, document_ids
from tlm_train import EvalBatches, LanguageModelLoss, TrainConfig, build_model, evaluate, train

EOT = "<|endoftext|>"


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A byte-level tokenizer with <|endoftext|> and a token file of short documents joined by it."""
    from tlm_tokenizer import Tokenizer

    folder = tmp_path_factory.mktemp("packed")
    tokenizer = Tokenizer({i: bytes([i]) for i in range(256)}, [], [EOT])
    rng = np.random.default_rng(0)
    documents = ["".join(rng.choice(list("abcdefgh "), size=rng.integers(3, 14))) for _ in range(150)]
    ids = np.asarray(tokenizer.encode(EOT.join(documents)), dtype=np.uint16)
    tokenizer.save(folder / "tok")
    np.save(folder / "ids.npy", ids)
    return folder, tokenizer


def test_the_validation_loss_is_the_document_masked_one(tmp_path, make_config, packed):
    folder, tokenizer = packed
    config = make_config(data=[str(folder / "ids.npy")], tokenizer=str(folder / "tok"), vocab_size=257, steps=1,
                         document_mask=True)  # fmt: skip
    result = train(config)
    # Step 0's validation loss, re-derived from the same initial weights with document ids of the inputs.
    saved = TrainConfig.from_toml(tmp_path / "run" / "train.toml")
    model = build_model(ModelConfig.from_dict(saved.model), "cpu", seed=config.seed)
    tokens = np.load(folder / "ids.npy")
    val = tokens[len(tokens) - max(1, round(len(tokens) * config.val_fraction)) :]
    batches = EvalBatches(val, config.batch_size, 16, windows=config.eval_batches * config.batch_size)
    eot = tokenizer.encode(EOT)[0]
    assert any(bool((inputs == eot).any()) for inputs, _ in batches)  # windows do cross documents
    masked = evaluate(LanguageModelLoss(model, document_mask_id=eot), batches).loss
    plain = evaluate(LanguageModelLoss(model), batches).loss
    assert result.val_losses[0][1] == pytest.approx(masked, rel=1e-6) and masked != pytest.approx(plain, rel=1e-4)
    # By hand: the loss module is the model's loss with the inputs' document ids.
    inputs, targets = next(iter(batches))
    expected = model.loss(inputs, targets, document_ids=document_ids(inputs, eot))
    assert LanguageModelLoss(model, document_mask_id=eot)(inputs, targets).item() == pytest.approx(expected.item())


def test_token_ids_without_a_tokenizer_are_refused(make_config):
    with pytest.raises(
        ValueError, match=re.escape("--document-mask splits windows at <|endoftext|>, which token-id data")
    ):
        train(make_config(document_mask=True))
