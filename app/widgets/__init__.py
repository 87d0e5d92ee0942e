"""Small widgets of the main window, one per file; each shows data it is given and fetches nothing."""
