#!/usr/bin/env bash
# Copy FermiNet's network and Hamiltonian source (google-deepmind/ferminet, Apache-2.0) into benchmarks/.ferminet/,
# git-ignored, for benchmarks/scaling.py's FermiNet rows. Nothing of it is committed or vendored into the package.
#
#   benchmarks/get_ferminet.sh PATH                  # PATH: a clone (work tree or bare git directory) of ferminet
#   benchmarks/get_ferminet.sh                       # clones https://github.com/google-deepmind/ferminet first
#
# What the benchmark uses: ferminet.networks.make_fermi_net (with envelopes, jastrows, network_blocks) and
# ferminet.hamiltonian.local_energy (with pseudopotential, utils). Two of their imports are left out, and this
# script writes stand-ins for them, so that neither kfac_jax nor pyscf is needed (the TPU machine has neither):
# - ferminet/curvature_tags_and_blocks.py imports kfac_jax for KFAC's layer tags; the envelopes call its
#   register_qmc, which is the identity on values (a tag only KFAC's curvature reads). It is replaced by a file
#   whose register_* return their output unchanged: the same program for the network and its local energy.
# - ferminet/pseudopotential.py and utils/pseudopotential.py import pyscf at module level and use it only for
#   pseudopotentials (local_energy's pp_symbols, unused here). stubs/pyscf is an empty module, put on the
#   path by the benchmark only where pyscf is not installed.
# vendor/ holds pure-Python packages FermiNet imports (attrs, typing_extensions), copied from this Python when it
# has them; the benchmark appends vendor/ to the end of sys.path, so an installed copy wins. chex and folx are
# not copied: install them (wheels) where the benchmark runs.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
dest="$here/.ferminet"
src="${1:-}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
if [ -z "$src" ]; then
  git clone --depth 1 https://github.com/google-deepmind/ferminet "$tmp/clone"
  src="$tmp/clone"
fi
rm -rf "$dest"
mkdir -p "$dest/stubs/pyscf" "$dest/vendor"
if [ -d "$src/ferminet" ]; then  # a work tree
  cp -r "$src/ferminet" "$dest/ferminet"
  commit="$(git -C "$src" rev-parse HEAD 2>/dev/null || echo unknown)"
else  # a bare git directory
  git --git-dir="$src" archive HEAD ferminet | tar -x -C "$dest"
  commit="$(git --git-dir="$src" rev-parse HEAD)"
fi
echo "$commit" > "$dest/COMMIT"
cat > "$dest/ferminet/curvature_tags_and_blocks.py" <<'PY'
"""Stand-in written by benchmarks/get_ferminet.sh: KFAC's layer tags as the identity (no kfac_jax needed)."""


def register_repeated_dense(y, x, w, b, **kwargs):
  del x, w, b, kwargs
  return y


def register_qmc(y, x, w, **kwargs):
  del x, w, kwargs
  return y
PY
echo '"""Stand-in written by benchmarks/get_ferminet.sh: FermiNet imports pyscf only for pseudopotentials."""' \
  > "$dest/stubs/pyscf/__init__.py"
python_bin="${PYTHON:-python3}"
"$python_bin" - "$dest/vendor" <<'PY' || echo "note: could not copy attrs/typing_extensions (install them)"
import importlib, os, shutil, sys
for name in ("attr", "attrs", "typing_extensions"):
    try:
        path = importlib.import_module(name).__file__
    except ImportError:
        print(f"note: {name} is not installed here: install it where the benchmark runs")
        continue
    if os.path.basename(path) == "__init__.py":
        shutil.copytree(os.path.dirname(path), os.path.join(sys.argv[1], name), ignore=shutil.ignore_patterns("__pycache__"))
    else:
        shutil.copy(path, sys.argv[1])
PY
echo "FermiNet $commit in $dest"
