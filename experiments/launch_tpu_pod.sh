#!/usr/bin/env bash
# Starts a config on every worker of a Cloud TPU VM (a single host or a pod slice).
#
#   bash experiments/launch_tpu_pod.sh --tpu=NAME --zone=ZONE [--project=P] \
#       --config=configs/default.py --workdir=gs://bucket/run \
#       [--repo=URL] [--branch=B] [--repo_dir=longhorizon] [--python=python3] \
#       [--skip_setup] [--dry_run] [-- extra experiments/train.py flags]
#
# Two `gcloud compute tpus tpu-vm ssh NAME --zone=ZONE --worker=all --command=...` calls:
#   1. setup (skipped with --skip_setup), on every worker: clone --repo at --branch into
#      ~/<repo_dir>, or fetch it and check it out (discarding edits made on the worker); create the
#      venv with `bash scripts/setup_env.sh` (PYTHON=--python, which must be >= 3.11), then install
#      `jax[tpu]` at the version of the jax already in the venv (so libtpu matches the pins).
#   2. train, on every worker at once:
#      `.venv/bin/python experiments/train.py --config=CONFIG --workdir=WORKDIR [extra flags]`.
# The train step starts only after setup succeeded, so no worker waits for a peer that never comes.
# The ssh session stays attached and gcloud streams every worker's output; run the launcher inside
# tmux/screen for long jobs (closing the session stops training; rerunning resumes from WORKDIR).
#
# Multi-host: each worker is one JAX process; `--distributed` makes experiments/train.py call
# `jax.distributed.initialize()` (no arguments: on Cloud TPU it finds the coordinator, process count
# and process id itself) before any other JAX call; every worker then sees the whole slice in
# `jax.devices()`. WORKDIR must be storage all workers share (e.g. gs://), and the training loop
# must write it through a filesystem layer that understands that scheme.
#
# Defaults: --repo is this checkout's `origin` URL and --branch its current branch. Workers clone
# what is pushed there, not local edits. --config is a path inside the repo (`:arg` allowed).
# --dry_run prints the exact gcloud commands, one per line and shell-quoted, and runs nothing.
# Missing or unknown flags print this usage and exit with code 2.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

usage() {
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
}

die_usage() {
  echo "launch_tpu_pod.sh: $1" >&2
  echo >&2
  usage >&2
  exit 2
}

tpu="" zone="" project="" config="" workdir="" repo="" branch="" repo_dir="longhorizon"
python_bin="python3" dry_run=0 skip_setup=0
extra=()
while [ $# -gt 0 ]; do
  arg="$1"
  shift
  case "$arg" in
    --) extra=("$@"); break ;;
    -h|--help) usage; exit 0 ;;
    --dry_run) dry_run=1; continue ;;
    --skip_setup) skip_setup=1; continue ;;
    --*=*) name="${arg%%=*}"; value="${arg#*=}" ;;
    --tpu|--zone|--project|--config|--workdir|--repo|--branch|--repo_dir|--python)
      [ $# -gt 0 ] || die_usage "$arg needs a value"
      name="$arg"; value="$1"; shift ;;
    *) die_usage "unknown argument '$arg' (train.py flags go after --)" ;;
  esac
  case "$name" in
    --tpu) tpu="$value" ;;
    --zone) zone="$value" ;;
    --project) project="$value" ;;
    --config) config="$value" ;;
    --workdir) workdir="$value" ;;
    --repo) repo="$value" ;;
    --branch) branch="$value" ;;
    --repo_dir) repo_dir="$value" ;;
    --python) python_bin="$value" ;;
    *) die_usage "unknown flag '$name' (train.py flags go after --)" ;;
  esac
done

if [ -z "$repo" ]; then
  repo="$(git -C "$ROOT" remote get-url origin 2>/dev/null || true)"
fi
if [ -z "$branch" ]; then
  branch="$(git -C "$ROOT" rev-parse --abbrev-ref HEAD 2>/dev/null || true)"
  [ "$branch" = "HEAD" ] && branch=""
fi
for required in tpu zone config workdir; do
  [ -n "${!required}" ] || die_usage "missing --$required"
done
[ -n "$repo" ] || die_usage "missing --repo (this checkout has no 'origin' remote to default to)"
[ -n "$branch" ] || die_usage "missing --branch (this checkout is not on a branch to default to)"
for flag in "${extra[@]+"${extra[@]}"}"; do
  case "$flag" in
    --*) ;;
    *) die_usage "extra train.py flags must look like --name=value, got '$flag'" ;;
  esac
done
if [ ! -f "$ROOT/${config%%:*}" ]; then
  echo "launch_tpu_pod.sh: warning: ${config%%:*} is not in this checkout; the workers need it" \
       "committed on $branch." >&2
fi

q() { printf '%q' "$1"; }  # one word, quoted for the worker's bash

dir="$(q "$repo_dir")"
setup="set -euo pipefail; if [ -d $dir/.git ]; then"
setup+=" git -C $dir fetch --quiet $(q "$repo") $(q "$branch");"
setup+=" git -C $dir checkout --quiet --force --detach FETCH_HEAD;"
setup+=" else git clone --quiet --branch $(q "$branch") $(q "$repo") $dir; fi;"
setup+=" cd $dir; PYTHON=$(q "$python_bin") bash scripts/setup_env.sh;"
setup+=' .venv/bin/python -m pip install --quiet "jax[tpu]==$(.venv/bin/python -c'
setup+=" 'import jax; print(jax.__version__)')\""

train="cd $dir && exec .venv/bin/python experiments/train.py --distributed $(q "--config=$config")"
train+=" $(q "--workdir=$workdir")"
for flag in "${extra[@]+"${extra[@]}"}"; do
  train+=" $(q "$flag")"
done

ssh=(gcloud compute tpus tpu-vm ssh "$tpu" "--zone=$zone" --worker=all)
[ -n "$project" ] && ssh+=("--project=$project")

commands=()
[ "$skip_setup" = 1 ] || commands+=("$setup")
commands+=("$train")

if [ "$dry_run" = 1 ]; then
  for remote in "${commands[@]}"; do
    line="$(printf '%q ' "${ssh[@]}" "--command=$remote")"
    echo "${line% }"
  done
  exit 0
fi

command -v gcloud >/dev/null || { echo "launch_tpu_pod.sh: gcloud not found; install the" \
  "Google Cloud CLI or use --dry_run to see the commands." >&2; exit 1; }
echo "launch_tpu_pod.sh: workers use $repo at $branch (pushed commits only)." >&2
for remote in "${commands[@]}"; do
  "${ssh[@]}" "--command=$remote"
done
