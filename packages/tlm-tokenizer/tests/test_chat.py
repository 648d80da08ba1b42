"""Chat templates: tlm's ids equal transformers' apply_chat_template on the saved folder; contents never become
control tokens; the assistant mask picks out exactly each assistant turn."""

import pytest

from tlm_tokenizer import Tokenizer
from tlm_tokenizer.chat import CHAT_MARKERS, CHATML_TEMPLATE, IM_END, ChatTemplate

transformers = pytest.importorskip("transformers")

SPECIALS = ["<|endoftext|>", *CHAT_MARKERS]
CONVERSATIONS = [
    [{"role": "user", "content": "Hello there!"}, {"role": "assistant", "content": "Hi. How can I help?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "  two leading spaces, a tab\tand\nnew lines\n"},
        {"role": "assistant", "content": " Sure:\n\n1. one\n2. two "},
        {"role": "user", "content": "Ünïcödé 日本語 🙂 and numbers 12345"},
        {"role": "assistant", "content": "ok"},
    ],
    [{"role": "user", "content": ""}, {"role": "assistant", "content": "<not a marker> <|im_start"}],
]


@pytest.fixture(scope="module")
def gpt2_chat(gpt2_tokenizer, tmp_path_factory):
    """GPT-2's BPE with the ChatML markers added as special tokens, the default template, saved and read by
    transformers."""
    ours = Tokenizer(gpt2_tokenizer.vocab, gpt2_tokenizer.merges, SPECIALS, chat_template=CHATML_TEMPLATE)
    folder = tmp_path_factory.mktemp("chat") / "tok"
    ours.save(folder)
    return ours, folder, transformers.AutoTokenizer.from_pretrained(folder), Tokenizer.load(folder)


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_ids_equal_transformers_apply_chat_template(gpt2_chat, conversation):
    ours, _, hf, loaded = gpt2_chat
    messages = CONVERSATIONS[conversation]
    expected = hf.apply_chat_template(messages, tokenize=True, return_dict=False)
    encoded = ChatTemplate(loaded, loaded.chat_template).encode(messages)  # the template as the folder holds it
    assert encoded.ids == list(expected)
    assert ChatTemplate(ours).render(messages) == hf.apply_chat_template(messages, tokenize=False)


def test_the_assistant_mask_is_each_assistant_turn_and_its_end_marker(gpt2_chat):
    ours = gpt2_chat[0]
    messages = CONVERSATIONS[1]
    encoded = ChatTemplate(ours).encode(messages)
    # Runs of masked ids, decoded: each assistant content with its end marker and the newline after it.
    runs, current = [], []
    for token, assistant in zip(encoded.ids, encoded.assistant, strict=True):
        if assistant:
            current.append(token)
        elif current:
            runs.append(ours.decode(current))
            current = []
    if current:
        runs.append(ours.decode(current))
    assert runs == [" Sure:\n\n1. one\n2. two <|im_end|>\n", "ok<|im_end|>\n"]
    assert encoded.trained("prompt") == [not a for a in encoded.assistant]
    assert encoded.trained("all") == [True] * len(encoded.ids)


def test_content_is_never_a_control_token(gpt2_chat):
    ours, _, hf, _ = gpt2_chat
    messages = [{"role": "user", "content": f"say {IM_END} now<|endoftext|>"}, {"role": "assistant", "content": "no"}]
    ids = ChatTemplate(ours).encode(messages).ids
    end = ours.encode(IM_END)[0]
    assert ids.count(end) == 2 and ours.encode("<|endoftext|>")[0] not in ids  # the template's two, none typed
    assert ours.decode(ids) == ChatTemplate(ours).render(messages)
    # transformers makes the typed marker a control token: the one place the ids are meant to differ.
    assert list(hf.apply_chat_template(messages, tokenize=True, return_dict=False)).count(end) == 3


def test_the_template_round_trips_through_the_folder_and_pickle(gpt2_chat):
    import pickle

    ours, _, _, loaded = gpt2_chat
    assert loaded.chat_template == CHATML_TEMPLATE
    assert pickle.loads(pickle.dumps(ours)).chat_template == CHATML_TEMPLATE


@pytest.mark.parametrize(
    ("template", "message"),
    [
        (
            "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}",
            "not write the messages' contents as they are",
        ),
        ("{% for m in messages %}{{ m['role'] }}{% endfor %}", "not write the messages' contents as they are"),
        ("{% for m in messages %", "not valid Jinja"),
        ("{{ raise_exception('no system messages') }}", "refused the conversation: no system messages"),
    ],
)
def test_templates_that_tlm_cannot_follow_are_refused_in_one_line(gpt2_chat, template, message):
    ours = gpt2_chat[0]
    with pytest.raises(ValueError, match=message):
        ChatTemplate(ours, template).encode(CONVERSATIONS[0])


@pytest.mark.parametrize("messages", [[], [{"role": "user"}], [{"content": "x"}], "text"])
def test_malformed_messages_are_refused(gpt2_chat, messages):
    with pytest.raises(ValueError, match="messages"):
        ChatTemplate(gpt2_chat[0]).encode(messages)
