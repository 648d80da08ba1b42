"""A LoRA step opened in a dtype it was not saved in (tlm_artifacts.load_model(..., dtype=)): the base with the
adapters merged, in that dtype, equal to tlm_lora's own merge of the same adapters cast to it."""

import torch

from tlm_artifacts import load_model, resolve
from tlm_model import save_model_file


def test_a_lora_step_opens_merged_in_the_dtype_asked_for(tmp_path, writers):
    from tlm_artifacts.lora import adapter_bytes, file_sha256
    from tlm_lora import merged_state_dict

    base = writers.model(1)
    save_model_file(base, tmp_path / "base")
    adapted, lora = writers.lora_step(base, tmp_path / "base")
    folder = tmp_path / "run" / "checkpoints" / "step_00000003"
    folder.mkdir(parents=True)
    data = adapter_bytes({k: v for k, v in adapted.state_dict().items() if ".lora_" in k})
    (folder / "adapter.safetensors").write_bytes(data)
    writers.write_state(folder / "train_state.pt", {"step": 3, "lora": lora, "adapter_sha256": file_sha256(data),
                                                    "model_config": writers.CONFIG.to_dict()})  # fmt: skip
    loaded, step = load_model(resolve(folder), dtype=torch.bfloat16)
    want = merged_state_dict(adapted.eval())
    assert step == 3 and {t.dtype for t in loaded.state_dict().values()} == {torch.bfloat16}
    assert all(torch.equal(loaded.state_dict()[k], want[k].to(torch.bfloat16)) for k in want)
