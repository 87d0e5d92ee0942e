"""The Settings dialog: swarm (and generate only), limits, schedule, start at login, identity.

Edits a copy of :class:`app.settings.AppSettings` and hands back a validated one
(``result_settings()``); an invalid entry is explained inside the dialog and the
dialog stays open. It shows the identity from the node's ``hello`` event and what
this machine supports (idle detection, battery). It does not save anything or
talk to the node; the main window does that on ``accepted``.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, Mapping

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QButtonGroup,
    QCheckBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFormLayout,
    QFrame,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QRadioButton,
    QSpinBox,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from app import autostart, style
from app.settings import SWARM_MODE_LABELS, SWARM_MODES, AppSettings, check_coordinator_url
from engine.control_protocol import LIMIT_FIELDS

#: limit -> (label, unit suffix, display scale (stored value * scale = shown value), decimals, step)
_LIMIT_UI: dict[str, tuple[str, str, float, int, float]] = {
    "memory_cap_gb": ("Memory", " GB", 1.0, 2, 0.5),
    "cpu_threads": ("Processor threads", " threads", 1.0, 0, 1),
    "gpu_fraction": ("GPU share", " %", 100.0, 0, 5),
    "upload_mbps": ("Upload", " Mbit/s", 1.0, 1, 1),
    "download_mbps": ("Download", " Mbit/s", 1.0, 1, 1),
}
_LIMIT_DEFAULT_SHOWN = {"memory_cap_gb": 8.0, "cpu_threads": float(os.cpu_count() or 4), "gpu_fraction": 80.0,
                        "upload_mbps": 20.0, "download_mbps": 50.0}
_KEY_STORAGE_WORDS = {"keyring": "Your operating system's keyring",
                      "file": "A private file in the Polis data folder (no usable system keyring was found)"}


def _muted(text: str) -> QLabel:
    label = QLabel(text)
    label.setObjectName("Muted")
    label.setWordWrap(True)
    return label


class SettingsDialog(QDialog):
    def __init__(self, settings: AppSettings, *, hello: Mapping[str, Any] | None = None,
                 idle_supported: bool = True, idle_reason: str = "", has_battery: bool | None = None,
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Polis settings")
        self.setMinimumWidth(560)
        self._original = settings
        layout = QVBoxLayout(self)
        layout.setContentsMargins(18, 16, 18, 14)
        self.tabs = QTabWidget()
        self.tabs.addTab(self._swarm_tab(settings), "Swarm")
        self.tabs.addTab(self._limits_tab(settings), "Limits")
        self.tabs.addTab(self._schedule_tab(settings, idle_supported, idle_reason, has_battery), "Schedule")
        self.tabs.addTab(self._system_tab(settings), "System")
        self.tabs.addTab(self._identity_tab(hello), "Identity")
        layout.addWidget(self.tabs)
        self.error_label = QLabel()
        self.error_label.setStyleSheet(f"color: {style.BAD}; font-weight: 600;")
        self.error_label.setWordWrap(True)
        self.error_label.hide()
        layout.addWidget(self.error_label)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Save | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        self.save_button = buttons.button(QDialogButtonBox.StandardButton.Save)
        layout.addWidget(buttons)

    # -- tabs -----------------------------------------------------------------------------

    def _swarm_tab(self, settings: AppSettings) -> QWidget:
        page = QWidget()
        layout = QVBoxLayout(page)
        layout.addWidget(_muted("How your node finds the other computers it trains with."))
        self.mode_group = QButtonGroup(page)
        self.mode_buttons: dict[str, QRadioButton] = {}
        for mode in SWARM_MODES:
            button = QRadioButton(SWARM_MODE_LABELS[mode])
            self.mode_group.addButton(button)
            self.mode_buttons[mode] = button
            layout.addWidget(button)
            if mode == "coordinator":
                self.url_edit = QLineEdit(settings.coordinator_url)
                self.url_edit.setPlaceholderText("https://swarm.example.org")
                row = QHBoxLayout()
                row.setContentsMargins(26, 0, 0, 0)
                row.addWidget(self.url_edit)
                layout.addLayout(row)
        self.mode_buttons[settings.swarm_mode].setChecked(True)
        self.mode_group.buttonToggled.connect(lambda *_: self._sync_enabled())
        layout.addSpacing(10)
        self.generate_only_check = QCheckBox("Generate only (no training)")
        self.generate_only_check.setChecked(settings.generate_only)
        help_text = ("Uses less memory: this computer serves generation and follows a trainer's weights "
                     "instead of training.")
        self.generate_only_check.setToolTip(help_text)
        layout.addWidget(self.generate_only_check)
        layout.addWidget(_muted(help_text))
        layout.addSpacing(10)
        layout.addWidget(_muted("A change of swarm or of “Generate only” takes effect the next time the node "
                                "starts."))
        layout.addStretch(1)
        self._sync_enabled()
        return page

    def _limits_tab(self, settings: AppSettings) -> QWidget:
        page = QWidget()
        outer = QVBoxLayout(page)
        outer.addWidget(_muted("Caps your node respects. Unticked means no limit. Changes apply at once, "
                               "also to a running node."))
        form = QFormLayout()
        form.setLabelAlignment(Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter)
        form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.FieldsStayAtSizeHint)
        form.setHorizontalSpacing(24)
        form.setVerticalSpacing(10)
        self.limit_checks: dict[str, QCheckBox] = {}
        self.limit_spins: dict[str, QDoubleSpinBox | QSpinBox] = {}
        for name, (kind, low, high, meaning) in LIMIT_FIELDS.items():
            label, suffix, scale, decimals, step = _LIMIT_UI.get(name, (name, "", 1.0, 2, 1.0))
            check = QCheckBox(label)
            check.setToolTip(meaning)
            if kind is int:
                spin: QDoubleSpinBox | QSpinBox = QSpinBox()
                spin.setRange(int(low), int(high))
            else:
                spin = QDoubleSpinBox()
                spin.setDecimals(decimals)
                spin.setRange(low * scale, high * scale)
            spin.setSingleStep(step)  # type: ignore[arg-type]
            spin.setSuffix(suffix)
            spin.setMinimumWidth(160)
            value = settings.limits.get(name)
            check.setChecked(value is not None)
            shown = value * scale if value is not None else _LIMIT_DEFAULT_SHOWN.get(name, low * scale)
            spin.setValue(int(shown) if kind is int else float(shown))  # type: ignore[arg-type]
            check.toggled.connect(lambda *_: self._sync_enabled())
            self.limit_checks[name], self.limit_spins[name] = check, spin
            form.addRow(check, spin)
        outer.addLayout(form)
        outer.addStretch(1)
        self._sync_enabled()
        return page

    def _schedule_tab(self, settings: AppSettings, idle_supported: bool, idle_reason: str,
                      has_battery: bool | None) -> QWidget:
        page = QWidget()
        layout = QVBoxLayout(page)
        self.idle_check = QCheckBox("Contribute only when the computer is idle")
        self.idle_check.setChecked(settings.run_only_when_idle)
        self.idle_minutes = QSpinBox()
        self.idle_minutes.setRange(1, 240)
        self.idle_minutes.setSuffix(" min without keyboard or mouse input")
        self.idle_minutes.setValue(int(round(settings.idle_after_min)))
        layout.addWidget(self.idle_check)
        row = QHBoxLayout()
        row.setContentsMargins(26, 0, 0, 0)
        row.addWidget(QLabel("Idle after"))
        row.addWidget(self.idle_minutes)
        row.addStretch(1)
        layout.addLayout(row)
        if not idle_supported:
            self.idle_check.setEnabled(False)
            layout.addWidget(_muted(idle_reason or "Idle detection is not supported on this platform."))
        self.idle_check.toggled.connect(lambda *_: self._sync_enabled())
        layout.addSpacing(10)
        self.ac_check = QCheckBox("Contribute only on AC power (pause on battery)")
        self.ac_check.setChecked(settings.run_only_on_ac_power)
        layout.addWidget(self.ac_check)
        if has_battery is None:
            layout.addWidget(_muted("No battery detected: this computer always counts as plugged in."))
        layout.addStretch(1)
        self._sync_enabled()
        return page

    def _system_tab(self, settings: AppSettings) -> QWidget:
        page = QWidget()
        layout = QVBoxLayout(page)
        self.login_check = QCheckBox("Start Polis when I log in (in the tray, contributing)")
        self.login_check.setChecked(settings.start_at_login)
        layout.addWidget(self.login_check)
        if autostart.is_supported():
            layout.addWidget(_muted(f"Login entry: {autostart.entry_location()}"))
        else:
            self.login_check.setEnabled(False)
            layout.addWidget(_muted("Start at login is not supported on this platform."))
        layout.addStretch(1)
        return page

    def _identity_tab(self, hello: Mapping[str, Any] | None) -> QWidget:
        page = QWidget()
        layout = QVBoxLayout(page)
        if not hello:
            layout.addWidget(_muted("Your identity is created the first time the node starts. "
                                    "Press Start, then open Settings again."))
        box = QFrame()
        box.setObjectName("Card")
        form = QFormLayout(box)
        form.setContentsMargins(16, 12, 16, 12)
        form.setVerticalSpacing(8)
        heading = QLabel("This computer in the swarm")
        heading.setObjectName("SectionTitle")
        form.addRow(heading)
        self.identity_labels: dict[str, QLabel] = {}
        storage = (hello or {}).get("key_storage")
        rows = (("peer_id", "Peer id", (hello or {}).get("peer_id")),
                ("fingerprint", "Public key fingerprint", (hello or {}).get("fingerprint")),
                ("key_storage", "Private key stored in", _KEY_STORAGE_WORDS.get(storage, storage)))
        for key, name, value in rows:
            label = QLabel(str(value) if value else "–")
            label.setWordWrap(True)
            label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
            self.identity_labels[key] = label
            name_label = QLabel(name)
            name_label.setObjectName("FieldName")
            form.addRow(name_label, label)
        layout.addWidget(box)
        layout.addWidget(_muted("The private key never leaves this computer and is never written to logs "
                                "or diagnostics."))
        layout.addStretch(1)
        return page

    # -- behaviour ------------------------------------------------------------------------

    def _sync_enabled(self) -> None:
        if hasattr(self, "url_edit"):
            self.url_edit.setEnabled(self.mode_buttons["coordinator"].isChecked())
        for name, check in getattr(self, "limit_checks", {}).items():
            self.limit_spins[name].setEnabled(check.isChecked())
        if hasattr(self, "idle_minutes"):
            self.idle_minutes.setEnabled(self.idle_check.isChecked() and self.idle_check.isEnabled())

    def result_settings(self) -> AppSettings:
        """The edited settings, validated (raises ``ValueError`` with a message for the user)."""
        mode = next(m for m, b in self.mode_buttons.items() if b.isChecked())
        url = self.url_edit.text().strip()
        if mode == "coordinator":
            check_coordinator_url(url)
        limits: dict[str, float | int | None] = {}
        for name, check in self.limit_checks.items():
            if not check.isChecked():
                limits[name] = None
                continue
            kind = LIMIT_FIELDS[name][0]
            scale = _LIMIT_UI.get(name, ("", "", 1.0, 2, 1.0))[2]
            value = self.limit_spins[name].value() / scale
            limits[name] = int(round(value)) if kind is int else round(float(value), 6)
        return replace(self._original, swarm_mode=mode, coordinator_url=url, limits=limits,
                       generate_only=self.generate_only_check.isChecked(),
                       run_only_when_idle=self.idle_check.isChecked() and self.idle_check.isEnabled(),
                       idle_after_min=float(self.idle_minutes.value()),
                       run_only_on_ac_power=self.ac_check.isChecked(),
                       start_at_login=self.login_check.isChecked()).validated()

    def accept(self) -> None:  # noqa: D401 - Qt override
        try:
            self.result_settings()
        except ValueError as exc:
            self.error_label.setText(str(exc))
            self.error_label.show()
            return
        self.error_label.hide()
        super().accept()
