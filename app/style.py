"""The app's look: colours, the Qt style sheet and the display states' colours and words.

Pure constants, the run colours and one function that builds the style sheet. Knows nothing about
the node or the settings.
"""

from __future__ import annotations

BACKGROUND = "#F5F6FA"
SURFACE = "#FFFFFF"
BORDER = "#E3E6EE"
TEXT = "#1F2430"
MUTED = "#6B7280"
ACCENT = "#4F46E5"
ACCENT_DARK = "#4338CA"
GOOD = "#16A34A"
WARN = "#D97706"
BAD = "#DC2626"
IDLE = "#9CA3AF"

#: colour of each run colour key of ``app.run_state`` (green only for "good": useful work is done).
RUN_COLORS: dict[str, str] = {"idle": IDLE, "busy": ACCENT, "warn": WARN, "good": GOOD, "bad": BAD}


def run_color(key: str) -> str:
    return RUN_COLORS.get(key, IDLE)


def style_sheet() -> str:
    return f"""
QMainWindow, QDialog {{ background: {BACKGROUND}; }}
QWidget {{ color: {TEXT}; font-size: 13px; }}
QLabel#AppTitle {{ font-size: 22px; font-weight: 700; }}
QLabel#Subtitle, QLabel.muted, QLabel#Muted {{ color: {MUTED}; }}
QLabel#SectionTitle {{ font-size: 14px; font-weight: 600; }}
QFrame#Card {{ background: {SURFACE}; border: 1px solid {BORDER}; border-radius: 12px; }}
QLabel#CardTitle {{ color: {MUTED}; font-size: 11px; font-weight: 600; letter-spacing: 0.5px; }}
QLabel#CardValue {{ font-size: 24px; font-weight: 700; }}
QLabel#CardSub {{ color: {MUTED}; font-size: 12px; }}
QLabel#FieldName {{ color: {MUTED}; }}
QLabel#FieldValue {{ font-weight: 600; }}
QPushButton {{ background: {SURFACE}; border: 1px solid {BORDER}; border-radius: 8px; padding: 6px 14px; }}
QPushButton:hover {{ border-color: {ACCENT}; }}
QPushButton:disabled {{ color: {IDLE}; }}
QPushButton#PrimaryButton {{ background: {ACCENT}; color: white; border: none; font-size: 17px;
    font-weight: 700; border-radius: 12px; padding: 12px 28px; }}
QPushButton#PrimaryButton:hover {{ background: {ACCENT_DARK}; }}
QPushButton#PrimaryButton[running="true"] {{ background: {SURFACE}; color: {TEXT}; border: 2px solid {BORDER}; }}
QPushButton#PrimaryButton[running="true"]:hover {{ border-color: {WARN}; }}
QTabWidget::pane {{ border: none; }}
QTabBar::tab {{ background: transparent; padding: 8px 16px; color: {MUTED}; font-weight: 600;
    border-bottom: 2px solid transparent; }}
QTabBar::tab:selected {{ color: {ACCENT}; border-bottom: 2px solid {ACCENT}; }}
QPlainTextEdit {{ background: {SURFACE}; border: 1px solid {BORDER}; border-radius: 8px;
    font-family: "DejaVu Sans Mono", "Menlo", "Consolas", monospace; font-size: 12px; }}
QLineEdit {{ background: {SURFACE}; border: 1px solid {BORDER}; border-radius: 6px; padding: 5px 8px; }}
QLineEdit:focus {{ border-color: {ACCENT}; }}
QLineEdit:disabled {{ color: {IDLE}; background: {BACKGROUND}; }}
"""
