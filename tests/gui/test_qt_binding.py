"""Guards against a Qt binding that corrupts CPython's reference counts (PySide6 6.12.0 under
CPython 3.11 drops a reference to None on every void call, so a live window aborts the
interpreter within minutes)."""

from __future__ import annotations

import sys

import pytest
from PySide6.QtWidgets import QLabel

CALLS = 2000


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="None is immortal from CPython 3.12 on")
def test_void_qt_calls_keep_the_reference_count_of_none(qtbot):
    label = QLabel()
    qtbot.addWidget(label)
    before = sys.getrefcount(None)
    for i in range(CALLS):
        label.setText(str(i))
    assert sys.getrefcount(None) - before > -CALLS // 2, "this PySide6 build decrements None on void calls"
