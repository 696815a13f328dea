"""Tiny models and trainers for the framework integrations (built from configs, no downloads):
a 2-block GPT-2 for the Hugging Face Trainer, an MLP LightningModule, and helpers that drive
them. Each is small enough that fp16 on the CPU stays quick."""

from __future__ import annotations

import torch
from torch import nn

from amp_tui.core.commands import Command

SEQ, VOCAB = 16, 128


# ---- Hugging Face ---------------------------------------------------------------------------------

def tiny_gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


class TokenData(torch.utils.data.Dataset):
    """Random token sequences, the labels the inputs (a language model's loss)."""

    def __init__(self, n: int = 64, seed: int = 1):
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def hf_trainer(tmp_path, *, steps: int = 6, precision: str = "bf16", accumulate: int = 1, cpu_fp16_scaler=None,
               model=None, data=None, device: str = "cpu", **arguments):
    """A Trainer on the CPU (`device="cuda"`: on the GPU). `cpu_fp16_scaler`: an init_scale; the
    run then gets what Accelerate gives fp16 on a GPU (autocast and a GradScaler), which on the
    CPU it gives no run."""
    from transformers import Trainer, TrainingArguments
    if cpu_fp16_scaler is not None:
        precision = "fp16"
    flags = {"bf16": {"bf16": True}, "fp16": {"fp16": True}, "fp32": {}}[precision]
    args = TrainingArguments(output_dir=str(tmp_path / "hf-out"), max_steps=steps, per_device_train_batch_size=4,
                             gradient_accumulation_steps=accumulate, use_cpu=device == "cpu",
                             report_to=arguments.pop("report_to", []),
                             save_strategy="no", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
                             **flags, **arguments)
    trainer = Trainer(model=model if model is not None else tiny_gpt2(), args=args,
                      train_dataset=data if data is not None else TokenData())
    if cpu_fp16_scaler is not None:
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=cpu_fp16_scaler)
        trainer.accelerator.native_amp = True   # prepare() wraps the forward in fp16 autocast
    return trainer


def hf_callback_class():
    from transformers import TrainerCallback
    return TrainerCallback


def at_steps(plan: dict[int, str], monitor_of):
    """A TrainerCallback that submits plan[global_step] (`save`, `restore=latest`, `dtype=fp32`...)
    to the monitor at the end of that optimizer step (applied at the next boundary)."""
    from amp_tui.core.commands import parse_action

    class Scheduled(hf_callback_class()):
        def on_step_end(self, args, state, control, **kwargs):
            text = plan.get(state.global_step)
            if text:
                monitor_of().controller.submit(parse_action(text, "api"))
    return Scheduled()


# ---- Lightning ------------------------------------------------------------------------------------

def lightning_module_class(package: str = "lightning"):
    import importlib
    pl = importlib.import_module("lightning.pytorch" if package == "lightning" else "pytorch_lightning")

    class TinyModule(pl.LightningModule):
        """An MLP on a regression whose targets reach ~300x the inputs: at fp16's init_scale
        65536 its first backwards overflow (a skipped step), in bf16 and fp32 they don't."""

        def __init__(self, gain: float = 1.0, optimizer: str = "adamw"):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
            self.gain, self.optimizer_kind = gain, optimizer

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self(x), y * self.gain)

        def configure_optimizers(self):
            opt = (torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True) if self.optimizer_kind == "fused"
                   else torch.optim.AdamW(self.parameters(), lr=1e-3))
            schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
    return TinyModule


def regression_loader(n: int = 64, batch: int = 4, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    return torch.utils.data.DataLoader(data, batch_size=batch)


def pl_trainer(callbacks, *, package: str = "lightning", steps: int = 6, **kwargs):
    import importlib
    pl = importlib.import_module("lightning.pytorch" if package == "lightning" else "pytorch_lightning")
    settings = {"max_steps": steps, "accelerator": "cpu", "devices": 1, "logger": False,
                "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False,
                **kwargs}
    return pl.Trainer(callbacks=list(callbacks), **settings)


def command(text: str) -> Command:
    from amp_tui.core.commands import parse_action
    return parse_action(text, "api")


# ---- scripts for `amp-tui run -- ...`: each trains until the dashboard stops it (or STEPS steps),
# with no other amp-tui line than its callback (the monitor, for Accelerate's own loop).

HF_SCRIPT = '''
import os
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from amp_tui.integrations.transformers import AmpTuiCallback

class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, 128, (64, 16), generator=torch.Generator().manual_seed(1))
    def __len__(self):
        return len(self.ids)
    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=16,
                                   bos_token_id=0, eos_token_id=0))
args = TrainingArguments(output_dir="hf-out", max_steps=int(os.environ.get("STEPS", "100000")),
                         per_device_train_batch_size=4, bf16=True, use_cpu=True, logging_steps=20,
                         save_strategy="no", report_to=[], disable_tqdm=True)
trainer = Trainer(model=model, args=args, train_dataset=Tokens())
trainer.add_callback(AmpTuiCallback(trainer))
trainer.train()
print("hf script: trained", trainer.state.global_step, "steps", flush=True)
'''

ACCELERATE_SCRIPT = '''
import os
import torch
from torch import nn
from accelerate import Accelerator
import amp_tui

accelerator = Accelerator(gradient_accumulation_steps=2)   # its precision from `accelerate launch`
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randn(64, 8)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
monitor = amp_tui.monitor(model, optimizer, scaler=accelerator.scaler)
steps = int(os.environ.get("STEPS", "100000"))
for epoch in range(steps):
    for xb, yb in loader:
        with accelerator.accumulate(model):
            with monitor.step() as step:
                loss = nn.functional.mse_loss(model(xb), yb)
                step.loss = loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
        if monitor.should_stop or monitor.step_index >= steps:
            break
    if monitor.should_stop or monitor.step_index >= steps:
        break
monitor.close()
print("accelerate script:", accelerator.mixed_precision, monitor.step_index, "steps", flush=True)
'''

LIGHTNING_SCRIPT = '''
import os
import lightning as L
import torch
from torch import nn
from amp_tui.integrations.lightning import AmpTuiCallback

class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

torch.manual_seed(0)
x = torch.randn(64, 8)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
trainer = L.Trainer(max_steps=int(os.environ.get("STEPS", "100000")), accelerator="cpu", devices=1,
                    precision="bf16-mixed", logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, callbacks=[AmpTuiCallback()])
trainer.fit(Regression(), loader)
print("lightning script: trained", trainer.global_step, "steps", flush=True)
'''
