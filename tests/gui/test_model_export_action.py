"""The window's "Export model..." action: only for the owner of a local demo, the node writes the
folder (the app sends the ``export`` command and never loads a model), and the folder is opened."""

from __future__ import annotations

from pathlib import Path

from app.model_export import ACTION_TEXT


def _wait_contributing(qtbot, window) -> None:
    qtbot.waitUntil(lambda: window.display_state == "contributing", timeout=6000)



def test_export_model_writes_the_folder_on_the_node_side_and_opens_it(qtbot, make_window, tmp_path):
    window = make_window(swarm_mode="demo")
    export = window.model_export
    assert ACTION_TEXT in [a.text() for a in window.menuBar().actions()[0].menu().actions()]
    assert not export.action.isEnabled()  # no node yet
    window.start_node()
    _wait_contributing(qtbot, window)
    qtbot.waitUntil(export.action.isEnabled, timeout=3000)
    opened: list[str] = []
    export.choose_folder = lambda: str(tmp_path / "exports")
    export.open_folder = opened.append
    export.action.trigger()
    assert not export.action.isEnabled()  # one export at a time
    qtbot.waitUntil(lambda: bool(opened), timeout=5000)
    folder = Path(opened[0])
    assert folder.parent == tmp_path / "exports" and folder.name.startswith("polis-model-")
    assert (folder / "README.md").read_text().startswith("---\nbase_model:")  # written by the node process
    assert export.action.isEnabled()
    assert any("written to" in line for line in window.log_view.lines())


def test_export_model_is_off_when_the_app_does_not_own_a_demo_swarm(qtbot, make_window, tmp_path):
    window = make_window(swarm_mode="lan")
    window.start_node()
    _wait_contributing(qtbot, window)
    assert not window.model_export.action.isEnabled()
    (tmp_path / "exports").mkdir()
    window.model_export.choose_folder = lambda: str(tmp_path / "exports")
    window.model_export.trigger()  # a stray trigger sends nothing
    assert window.model_export.pending is None and not list((tmp_path / "exports").iterdir())


def test_a_cancelled_folder_choice_sends_nothing(qtbot, make_window):
    window = make_window(swarm_mode="demo")
    window.start_node()
    _wait_contributing(qtbot, window)
    qtbot.waitUntil(window.model_export.action.isEnabled, timeout=3000)
    window.model_export.choose_folder = lambda: None
    window.model_export.trigger()
    assert window.model_export.pending is None and window.model_export.action.isEnabled()
