"""Demo: the Hugging Face Trainer under amp-tui, with an fp16 overflow fixed from the dashboard.

A plain Trainer script (a small GPT-2 built from a config, no download; a dataset of counting
sequences), plus the one line that makes amp-tui record it and lets the dashboard steer it:

    trainer.add_callback(AmpTuiCallback(trainer))

What it reproduces
    The first block's MLP input projection, ``transformer.h.0.mlp.c_fc``, has weights ~1e5x the
    initialisation, as an outlier feature does, so its outputs pass fp16's 65504: they are inf,
    and the loss is NaN from the first step. GradScaler skips every update and halves its scale,
    which can't help (the forward overflows, not the gradients). The Trainer's own logs show a
    number all along: logging_nan_inf_filter replaces a NaN loss by the recent average.

Fix it live
    amp-tui run -- python demos/hf_trainer.py
    then press d in the dashboard: fp16 -> bf16 (fp32's range, and the GradScaler scales by 1),
    and the loss falls from the next step on. The event log names transformer.h.0.mlp.c_fc.

On a machine without a GPU Accelerate gives fp16 neither autocast nor a GradScaler (the run
would train in fp32, and amp-tui says so): there this demo hands the Trainer both, as a GPU run
has them, so that the overflow shows on the CPU too.

Options: --steps (default 3000), --precision (fp16, bf16 or fp32; default fp16), --gain (1e5;
100 keeps fp16 finite), --batch-size (16), --lr (1e-3).
"""

import argparse
import atexit
import shutil
import tempfile

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from amp_tui.integrations.transformers import AmpTuiCallback

VOCAB, SEQ = 256, 32


class Counting(Dataset):
    """Sequences that count up by a step of 1-4 from a random start: next-token prediction a small
    model learns in a few hundred steps."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        stride = torch.randint(1, 5, (n, 1), generator=g)
        self.ids = (start + stride * torch.arange(SEQ)) % VOCAB

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--precision", choices=("fp16", "bf16", "fp32"), default="fp16")
    p.add_argument("--gain", type=float, default=1e5)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    args = p.parse_args()

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight.mul_(args.gain)
    gpu = torch.cuda.is_available()
    output_dir = tempfile.mkdtemp(prefix="hf-trainer-demo-")   # the Trainer wants one; nothing is saved
    atexit.register(shutil.rmtree, output_dir, ignore_errors=True)
    training = TrainingArguments(
        output_dir=output_dir, max_steps=args.steps,
        per_device_train_batch_size=args.batch_size, learning_rate=args.lr, lr_scheduler_type="constant",
        fp16=args.precision == "fp16", bf16=args.precision == "bf16", use_cpu=not gpu, logging_steps=50,
        save_strategy="no", report_to=[], disable_tqdm=True)
    trainer = Trainer(model=model, args=training, train_dataset=Counting(4096, seed=1))
    if args.precision == "fp16" and not gpu:
        # What Accelerate gives fp16 on a GPU: a GradScaler, and prepare() wrapping the forward in
        # fp16 autocast. On the CPU it gives neither; a real script needs none of this.
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu")
        trainer.accelerator.native_amp = True
    trainer.add_callback(AmpTuiCallback(trainer))
    trainer.train()


if __name__ == "__main__":
    main()
