#!/usr/bin/env bash
# Writes a byte-level BPE `tokenizer.json` (the kind GPT-2, Llama 3 and Qwen ship, with
# ChatML's special tokens), trained on Python's own standard library sources: a real
# tokenizer's cost without downloading a model. For the tokenizer benchmarks only.
#
#   tools/bpe-tokenizer.sh OUT.json [VOCAB_SIZE]
#
# Installs Hugging Face's `tokenizers` into the peers' virtualenv
# ($SWITCHYARD_PEERS_VENV, default ~/.cache/switchyard/peers) on first use.
set -euo pipefail
out=${1:?usage: tools/bpe-tokenizer.sh OUT.json [VOCAB_SIZE]}
vocab=${2:-32000}
venv=${SWITCHYARD_PEERS_VENV:-$HOME/.cache/switchyard/peers}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -c 'import tokenizers' 2>/dev/null \
    || "$venv/bin/pip" install --quiet tokenizers==0.23.3
"$venv/bin/python" - "$out" "$vocab" <<'PY'
import glob, sys, sysconfig
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

out, vocab = sys.argv[1], int(sys.argv[2])
def texts():
    for path in sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/**/*.py", recursive=True)):
        try:
            with open(path, encoding="utf-8") as f:
                yield f.read()
        except (UnicodeDecodeError, OSError):
            pass


tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(
    vocab_size=vocab,
    special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
)
tok.train_from_iterator(texts(), trainer)
tok.save(out)
print(f"{out}: byte-level BPE, {tok.get_vocab_size()} tokens")
PY
