"""``from pkgd import LLM, SamplingParams`` is lazy: importing pkgd does not import torch."""

import subprocess
import sys


def test_top_level_names_are_lazy_and_torch_free():
    code = (
        "import sys\n"
        "import pkgd\n"
        "from pkgd import LLM, SamplingParams, BeamSearchParams, RequestOutput\n"
        "assert LLM.__module__ == 'pkgd.offline.llm' and SamplingParams().max_tokens == 16\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "try:\n"
        "    pkgd.NoSuchThing\n"
        "except AttributeError as e:\n"
        "    assert 'NoSuchThing' in str(e)\n"
        "else:\n"
        "    raise AssertionError('no AttributeError')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
