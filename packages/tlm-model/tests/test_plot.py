"""``plot_shares``: one bar per report, its components stacked in ``COMPONENTS`` order to 100%, each segment as tall
as the report's share of the forward matmul FLOPs, the larger ones labelled in their middle, and the file written in
the format its suffix names."""

import pytest

from tlm_model import PRESETS
from tlm_model.accounting import COMPONENTS, account
from tlm_model.plot import plot_shares

matplotlib = pytest.importorskip("matplotlib")


@pytest.mark.parametrize("causal", [False, True])
def test_each_bar_stacks_the_reports_shares_to_100_percent(tmp_path, monkeypatch, causal):
    import matplotlib.pyplot as plt

    figures = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig: (figures.append(fig), close(fig)))
    reports = [(name, account(PRESETS[name], seq_len=256)) for name in ("tiny", "gpt2-small")]
    plot_shares(reports, str(tmp_path / "shares.svg"), causal=causal)
    assert (tmp_path / "shares.svg").read_text().lstrip().startswith("<?xml")  # the suffix picks the format
    (ax,) = figures[0].axes
    assert [t.get_text() for t in ax.get_legend().get_texts()] == list(COMPONENTS.values())
    segments = ax.patches  # component by component, one bar per report in each
    assert len(segments) == len(COMPONENTS) * len(reports)
    for i, (_, report) in enumerate(reports):
        shares = report.shares(causal)
        below = 0.0
        for j, component in enumerate(COMPONENTS):
            bar = segments[j * len(reports) + i]
            assert bar.get_x() + bar.get_width() / 2 == pytest.approx(i)  # the report's own bar
            assert (bar.get_y(), bar.get_height()) == pytest.approx((below, 100 * shares[component]))
            below += 100 * shares[component]
        assert below == pytest.approx(100)
    for text in ax.texts:  # a label sits in the middle of its segment and gives that segment's share
        x, y = text.get_position()
        (bar,) = [b for b in segments if abs(b.get_x() + b.get_width() / 2 - x) < 1e-9 and b.get_y() < y < b.get_y()
                  + b.get_height()]  # fmt: skip
        assert y == pytest.approx(bar.get_y() + bar.get_height() / 2)
        assert text.get_text() == f"{bar.get_height():.0f}%"
    assert ax.texts  # the larger segments are labelled


def test_the_file_is_replaced_whole_and_a_symlink_there_is_not_followed(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    reports = [("tiny", account(PRESETS["tiny"], seq_len=64))]
    victim, target = tmp_path / "victim", tmp_path / "shares.png"
    victim.write_bytes(b"keep")
    target.symlink_to(victim)
    plot_shares(reports, str(target))
    assert victim.read_bytes() == b"keep"  # the link itself was replaced
    assert not target.is_symlink() and target.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    old = target.read_bytes()

    def fail_midway(fig, file, **kwargs):
        file.write(b"\x89PNG half a picture")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", fail_midway)
    with pytest.raises(OSError, match="No space left"):
        plot_shares(reports, str(target))
    assert target.read_bytes() == old  # the old picture, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shares.png", "victim"]  # no temporary left
