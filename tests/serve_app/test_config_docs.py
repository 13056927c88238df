"""docs/configuration.md is generated from the config models; a stale copy fails here."""

from __future__ import annotations

from serve_app.config import DOCS_PATH, _rows, main, render_docs, sections


def test_the_committed_configuration_page_matches_the_models():
    text = DOCS_PATH.read_text()
    assert render_docs().rstrip("\n") in text, (
        "docs/configuration.md is stale: run `python -m serve_app.config --docs` and commit it")
    assert main(["--check"]) == 0


def test_the_page_lists_every_key_of_every_section_with_its_default():
    page = render_docs()
    section_paths = {path for path, _ in sections()}
    for path, tp in sections():
        if path:
            assert f"### `{path.replace('workers', 'workers[]', 1) if path == 'workers' else path}`" in page
        for name, _, _, _ in _rows(tp):
            key = f"{path}.{name}" if path else name
            if key not in section_paths:
                assert f"| `{name}` |" in page, f"{key} is missing from the page"
    assert "| `report_latency_s` | `float` | `0.1` |" in page
    assert "| `min_overlap_blocks` | `int` | `1` |" in page


def test_the_check_fails_on_a_stale_page(tmp_path):
    stale = tmp_path / "configuration.md"
    stale.write_text(DOCS_PATH.read_text().replace("| `report_latency_s` | `float` | `0.1` |",
                                                   "| `report_latency_s` | `float` | `0.5` |"))
    assert main(["--docs", str(stale), "--check"]) == 1
    assert main(["--docs", str(stale)]) == 0  # regenerating repairs it, hand-written parts kept
    assert stale.read_text() == DOCS_PATH.read_text()
