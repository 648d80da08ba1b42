"""tlm_command.openai_api.responses' own pieces, checked without a server: chat ``logprobs`` entries."""

from tlm_command.openai_api.responses import chat_logprobs
from tlm_model.scheduler import Scored


class ByteTokenizer:
    vocab_size = 256

    def decode_bytes(self, ids):
        return bytes(ids)


def test_chat_logprobs_keep_a_certain_tokens_zero_and_give_none_as_zero():
    entries = chat_logprobs(ByteTokenizer(), [Scored(104, 0.0, [(104, 0.0)]), Scored(105, None, []),
                                              Scored(300, -1.5, [(105, -0.5)])])  # fmt: skip
    # None is given as 0.0; a certain token's 0.0 stays 0.0; a token outside the vocabulary (a padded head's)
    # has no bytes.
    assert entries == [
        {"token": "h", "logprob": 0.0, "bytes": [104],
         "top_logprobs": [{"token": "h", "logprob": 0.0, "bytes": [104]}]},
        {"token": "i", "logprob": 0.0, "bytes": [105], "top_logprobs": []},
        {"token": "", "logprob": -1.5, "bytes": [], "top_logprobs": [{"token": "i", "logprob": -0.5, "bytes": [105]}]},
    ]  # fmt: skip
