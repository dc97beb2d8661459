"""Exit 1, saying why, when the installed llama.cpp cannot measure (make setup rebuilds it)."""

import sys

from harness.engine.llama import build_problem

problem = build_problem()
if problem:
    print(f"check_llama_build: {problem}; rebuilding without them", file=sys.stderr)
    sys.exit(1)
