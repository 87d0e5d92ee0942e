#!/bin/sh
# Put Polis in your applications menu (for this user only; no root needed):
#     ./install.sh              menu entry + icon, and `polis` in ~/.local/bin
#     ./install.sh --uninstall  remove them again (then delete this folder to remove the app)
# Polis runs from this folder: move the folder where you want it to live *before* running this.
# The system packages the window needs are listed in SYSTEM-PACKAGES.txt; this script checks them.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
data=${XDG_DATA_HOME:-$HOME/.local/share}
apps="$data/applications"
icons="$data/icons/hicolor"
bin="$HOME/.local/bin"

refresh() {
    command -v update-desktop-database >/dev/null 2>&1 && update-desktop-database "$apps" >/dev/null 2>&1 || true
    command -v gtk-update-icon-cache >/dev/null 2>&1 && gtk-update-icon-cache -q -t "$icons" >/dev/null 2>&1 || true
}

if [ "${1:-}" = "--uninstall" ]; then
    rm -f "$apps/polis.desktop" "$icons/256x256/apps/polis.png" "$icons/512x512/apps/polis.png"
    if [ -L "$bin/polis" ]; then rm -f "$bin/polis"; fi
    refresh
    echo "Removed Polis from the applications menu. Delete $here to remove the app itself."
    exit 0
fi

mkdir -p "$apps" "$icons/256x256/apps" "$icons/512x512/apps" "$bin"
cp "$here/polis-256.png" "$icons/256x256/apps/polis.png"
cp "$here/polis-512.png" "$icons/512x512/apps/polis.png"
escaped=$(printf '%s' "$here" | sed 's/[\\|&]/\\&/g')
sed -e "s|^Exec=.*|Exec=\"$escaped/polis\"|" -e "s|^TryExec=.*|TryExec=$escaped/polis|" \
    "$here/polis.desktop" > "$apps/polis.desktop"
chmod 0644 "$apps/polis.desktop"
ln -sf "$here/polis" "$bin/polis"
refresh
echo "Polis is now in your applications menu (and \`polis\` is in $bin)."
# The window needs Qt's X11 libraries from the system (see SYSTEM-PACKAGES.txt): say what is missing.
"$here/polis" gui --check-system || true
