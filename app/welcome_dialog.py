"""The first-run welcome: what Polis will do to this computer and its network, and a consent button.

Shown before the first Start; the answer is stored by the caller (``consent_given``).
Knows nothing about the node or the settings store.
"""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QDialog, QDialogButtonBox, QLabel, QVBoxLayout, QWidget

from app.icons import app_icon

WELCOME_HTML = """
<p>Polis trains a shared language model with reinforcement learning, together with other
people's computers. The model is split into stages; your computer serves one stage.</p>
<p><b>What it uses on this computer</b></p>
<ul>
<li>Your graphics card, Apple chip or processor, and memory, while Polis is contributing.
    You can cap memory, processor threads / GPU share and bandwidth in <i>Settings → Limits</i>,
    and let Polis run only when the computer is idle or plugged in.</li>
<li>A little disk space for the model layers of your stage and the logs.</li>
</ul>
<p><b>What goes over the network</b></p>
<ul>
<li>A connection to the swarm's coordinator (found on your local network, or the URL you set).</li>
<li>Encrypted peer-to-peer connections (WebRTC) to the computers serving the neighbouring stages:
    intermediate activations, gradients and compressed model updates — no personal files, ever.</li>
</ul>
<p><b>Your identity</b>: Polis creates a key pair on this computer. The private key stays here (in your
system keyring where available); others see only a short peer id and the key's fingerprint.</p>
<p>You can pause at any time. Closing the window keeps Polis contributing in the system tray;
<i>Quit</i> stops it.</p>
"""


class WelcomeDialog(QDialog):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Welcome to Polis")
        self.setWindowIcon(app_icon())
        self.setMinimumWidth(560)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(24, 20, 24, 16)
        layout.setSpacing(10)
        title = QLabel("Welcome to Polis")
        title.setObjectName("AppTitle")
        layout.addWidget(title)
        body = QLabel(WELCOME_HTML)
        body.setWordWrap(True)
        body.setTextFormat(Qt.TextFormat.RichText)
        layout.addWidget(body)
        self.buttons = QDialogButtonBox()
        self.agree_button = self.buttons.addButton("I agree — start contributing",
                                                   QDialogButtonBox.ButtonRole.AcceptRole)
        self.agree_button.setObjectName("PrimaryButton")
        self.agree_button.setStyleSheet("font-size: 14px; padding: 8px 18px;")
        self.decline_button = self.buttons.addButton("Not now", QDialogButtonBox.ButtonRole.RejectRole)
        self.buttons.accepted.connect(self.accept)
        self.buttons.rejected.connect(self.reject)
        layout.addWidget(self.buttons)
