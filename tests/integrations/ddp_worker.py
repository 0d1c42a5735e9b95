"""Run scripts/train.py's main() and save this rank's final weights and loss curve (for test_ddp)."""
import json
import os
import sys
from pathlib import Path

import train
from safetensors.torch import save_file

dump = Path(sys.argv[1])
result = train.main(sys.argv[2:])
rank = int(os.environ.get("RANK", 0))
state = result["model"].state_dict().items()
save_file({k: v.detach().clone().contiguous() for k, v in state if k != "lm_head.weight"},
          str(dump / f"rank{rank}.safetensors"))
(dump / f"rank{rank}.json").write_text(json.dumps({"curve": result["curve"]}))
