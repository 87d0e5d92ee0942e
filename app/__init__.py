"""Polis desktop app (PySide6): the window, tray icon and settings over a ``polis node`` child process.

Only the GUI lives here. It talks to the node through ``engine.control_protocol``
(JSON lines over the child's stdin/stdout) and never imports torch or mlx;
nothing outside ``app`` imports it.
"""
