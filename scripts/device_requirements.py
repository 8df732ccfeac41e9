"""The Python packages the device check needs beyond a GPU image's jax[cuda], flax, optax, orbax,
chex and numpy (found by importing the check and its test subset in a venv holding only those).

    python scripts/device_requirements.py             # every distribution, one per line
    python scripts/device_requirements.py --missing   # those this python cannot import, one line

`scripts/device_wheels.sh` downloads them into .device_wheels/; `scripts/device_check.sh` installs
the missing ones from there (the device machine reaches no package index).
"""

import importlib.util
import sys

# import name -> distribution (pinned to what this repository's venv was tested with)
REQUIREMENTS = {
    "safetensors": "safetensors==0.8.0",
    "ml_collections": "ml-collections==1.1.0",
    "gguf": "gguf==0.19.0",
    "tokenizers": "tokenizers==0.23.3",
    "transformers": "transformers==5.24.0",
    "packaging": "packaging",
    "regex": "regex",
    "huggingface_hub": "huggingface-hub",
    "tqdm": "tqdm",
    "httpx2": "httpx2",
    "idna": "idna",
    "filelock": "filelock",
    "httpcore2": "httpcore2",
    "truststore": "truststore",
    "h11": "h11",
    "yaml": "PyYAML",
    "pytest": "pytest",
    "pluggy": "pluggy",
    "iniconfig": "iniconfig",
    "hypothesis": "hypothesis",
    "sortedcontainers": "sortedcontainers",
}


def missing() -> list[str]:
  return [dist for module, dist in REQUIREMENTS.items() if importlib.util.find_spec(module) is None]


if __name__ == "__main__":
  if sys.argv[1:] == ["--missing"]:
    print(" ".join(missing()))
  elif not sys.argv[1:]:
    print("\n".join(REQUIREMENTS.values()))
  else:
    sys.exit(f"usage: python {sys.argv[0]} [--missing]")
