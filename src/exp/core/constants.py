"""Values several layers agree on, kept where every layer may read them (and none needs torch to)."""

from pathlib import Path

# The Hydra config tree of the checkout (conf/): composed by exp.run.compose, read as YAML by the preflight.
CONF_DIR = Path(__file__).resolve().parents[3] / "conf"

# The label cross-entropy skips: prompt tokens and padding (the data writes it, the losses and metrics read it).
IGNORE_INDEX = -100

# Tokens per chunk of the chunked loss (exp.model.loss): those whose fp32 logits take ~256 MiB (262 tokens of a 256k
# vocabulary). The chunk's matmul is then large enough to run at full speed on a GPU, and its few fp32
# [chunk, vocab] temporaries stay well under a GiB. The memory estimate (exp.hardware.memory) counts the same chunk.
CHUNK_LOGIT_BYTES = 256 * 2**20

# Set by `exp.train` in each rank of a torchrun / SLURM launch: the launch's id (`exp.run.dirs.shared_launch_id`),
# recorded in status.json so that the ranks share one run directory and never take over an earlier launch's. The
# preflight reads it to tell the ranks of one launch apart from unrelated processes.
LAUNCH_ID_ENV = "EXP_LAUNCH_ID"
