"""Chat templates' products under the bound (tlm_tokenizer.chat): a repetition of at most MAX_PRODUCT items renders
as jinja2's own sandbox renders it; one item more is refused."""

import jinja2.sandbox
import pytest

from tlm_tokenizer.chat import MAX_PRODUCT, compile_template


def test_small_repetitions_render_as_jinjas_sandbox_renders_them():
    source = "{{ '-' * 3 }}|{{ [0, 1] * 2 }}|{{ 2 * 'ab' }}|{{ (1,) * 3 }}|{{ 3 * 4 }}"
    want = jinja2.sandbox.ImmutableSandboxedEnvironment().from_string(source).render()
    assert (
        compile_template(source)(messages=[], add_generation_prompt=False)
        == want
        == "---|[0, 1, 0, 1]|abab|(1, 1, 1)|12"
    )


def test_a_repetition_of_exactly_the_bound_renders_and_one_more_is_refused():
    render = compile_template(f"{{{{ ('x' * {MAX_PRODUCT}) | length }}}}")
    assert render(messages=[], add_generation_prompt=False) == str(MAX_PRODUCT)
    with pytest.raises(ValueError, match=f"a repetition of {MAX_PRODUCT + 1:,} items is over {MAX_PRODUCT:,}"):
        compile_template(f"{{{{ 'x' * {MAX_PRODUCT + 1} }}}}")(messages=[], add_generation_prompt=False)
