"""DeepSpeed-style client programs and their plain-PyTorch references.

Each ``*_loop`` is written as DeepSpeed's own examples are (``import ds_core as deepspeed``,
``deepspeed.initialize``, ``engine.backward``/``engine.step``), with nothing adapted to ds_core;
each ``*_reference`` trains the same model in one process on the global batch (every rank's
samples) with ``torch.optim``. The loops run on every rank of a process group on the selected
backend (tests/compat/_worker.py) and put their batches on the engine's device, as DeepSpeed's
examples do (``.to(device)``, ``device=`` for tensors made in the loop).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

HIDDEN = 10
MICRO = 4
LR = 1e-2
#: gradient_clipping when a config does not set it (DeepSpeed 0.19.8 runtime/constants.py:
#: GRADIENT_CLIPPING_DEFAULT); the plain-PyTorch twins clip as the engine then does.
CLIP = 1.0


def stage_config(stage: int, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": 1000,
        "optimizer": {"type": "Adam", "params": {"lr": LR}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    cfg.update(extra)
    return cfg


# ------------------------------------------------------------------------------ SimpleModel


class SimpleModel(nn.Module):
    """DeepSpeed's unit-test model (tests/unit/simple_model.py): linears, then the loss."""

    def __init__(self, hidden_dim: int, nlayers: int = 1) -> None:
        super().__init__()
        self.linears = nn.ModuleList([nn.Linear(hidden_dim, hidden_dim) for _ in range(nlayers)])
        self.cross_entropy_loss = nn.CrossEntropyLoss()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.linears:
            x = layer(x)
        return self.cross_entropy_loss(x, y)


SIMPLE_STEPS, SIMPLE_GAS = 3, 2


def simple_data(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global samples, micro-batch-major: micro m holds rows [m*world*MICRO, (m+1)*world*MICRO)."""
    g = torch.Generator().manual_seed(11)
    n = SIMPLE_STEPS * SIMPLE_GAS * world * MICRO
    return torch.randn(n, HIDDEN, generator=g), torch.randint(0, HIDDEN, (n,), generator=g)


def simple_loop(stage: int, world: int, rank: int, load: bool = False) -> dict[str, Any]:
    """DeepSpeed's unit-test loop; with ``load``, the model starts from other weights and
    ``engine.load_state_dict`` (DeepSpeed's ``module.``-prefixed keys) puts the reference
    start in, so a match also proves the shards and fp32 masters were written."""
    import ds_core as deepspeed

    config_dict = stage_config(stage, gradient_accumulation_steps=SIMPLE_GAS, gradient_clipping=1.0)
    torch.manual_seed(0)
    start = {f"module.{k}": v for k, v in SimpleModel(HIDDEN, nlayers=2).state_dict().items()}
    torch.manual_seed(1 if load else 0)
    model = SimpleModel(hidden_dim=HIDDEN, nlayers=2)
    model, _, _, _ = deepspeed.initialize(
        config=config_dict, model=model, model_parameters=model.parameters()
    )
    if load:
        model.load_state_dict(start)
    xs, ys = simple_data(world)
    data_loader = [
        (
            xs[i + rank * MICRO : i + (rank + 1) * MICRO],
            ys[i + rank * MICRO : i + (rank + 1) * MICRO],
        )
        for i in range(0, len(xs), world * MICRO)
    ]
    losses = []
    for _, batch in enumerate(data_loader):
        loss = model(batch[0].to(model.device), batch[1].to(model.device))
        model.backward(loss)
        model.step()
        losses.append(loss.item())
    return {"losses": losses, "state": model.module_state_dict()}


def simple_reference(world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = SimpleModel(hidden_dim=HIDDEN, nlayers=2)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    xs, ys = simple_data(world)
    width = world * MICRO
    for s in range(SIMPLE_STEPS):
        for m in range(SIMPLE_GAS):
            lo = (s * SIMPLE_GAS + m) * width
            (model(xs[lo : lo + width], ys[lo : lo + width]) / SIMPLE_GAS).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return {"state": model.state_dict()}


def autocast_loop(stage: int, world: int, rank: int) -> dict[str, Any]:
    """``torch_autocast`` (bfloat16): the engine's forward under ``torch.autocast``."""
    import ds_core as deepspeed

    cfg = stage_config(stage, torch_autocast={"enabled": True, "dtype": "bfloat16"})
    torch.manual_seed(0)
    model = SimpleModel(hidden_dim=HIDDEN, nlayers=2)
    engine, _, _, _ = deepspeed.initialize(config=cfg, model=model)
    xs, ys = simple_data(world)
    xs, ys = xs.to(engine.device), ys.to(engine.device)
    width = world * MICRO
    for s in range(SIMPLE_STEPS):
        mine = slice(s * width + rank * MICRO, s * width + (rank + 1) * MICRO)
        engine.backward(engine(xs[mine], ys[mine]))
        engine.step()
    return {"state": engine.module_state_dict()}


def autocast_reference(world: int) -> dict[str, Any]:
    """Each rank's micro-batch forward under autocast on its own (bf16 matmuls see the same
    rows as on that rank), the losses averaged as the ranks' gradients are."""
    torch.manual_seed(0)
    model = SimpleModel(hidden_dim=HIDDEN, nlayers=2)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    xs, ys = simple_data(world)
    width = world * MICRO
    for s in range(SIMPLE_STEPS):
        total = torch.zeros(())
        for r in range(world):
            mine = slice(s * width + r * MICRO, s * width + (r + 1) * MICRO)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                total = total + model(xs[mine], ys[mine]).float()
        (total / world).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)  # DeepSpeed's default clip
        opt.step()
        opt.zero_grad()
    return {"state": model.state_dict()}


def nosync_loop(world: int, rank: int) -> dict[str, Any]:
    """Stage 0: the first micro-batch's backward inside ``no_sync()``, the second outside,
    then one step: the update sums both micro-batches' gradients."""
    import ds_core as deepspeed

    torch.manual_seed(0)
    model = SimpleModel(hidden_dim=HIDDEN, nlayers=2)
    engine, _, _, _ = deepspeed.initialize(config=stage_config(0), model=model)
    xs, ys = simple_data(world)
    xs, ys = xs.to(engine.device), ys.to(engine.device)
    width = world * MICRO
    mine = [slice(m * width + rank * MICRO, m * width + (rank + 1) * MICRO) for m in range(2)]
    with engine.no_sync():
        engine.backward(engine(xs[mine[0]], ys[mine[0]]))
    engine.backward(engine(xs[mine[1]], ys[mine[1]]))
    engine.step()
    return {"state": engine.module_state_dict()}


def nosync_reference(world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = SimpleModel(hidden_dim=HIDDEN, nlayers=2)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    xs, ys = simple_data(world)
    width = world * MICRO
    for m in range(2):
        model(xs[m * width : (m + 1) * width], ys[m * width : (m + 1) * width]).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)  # DeepSpeed's default clip
    opt.step()
    return {"state": model.state_dict()}


# ------------------------------------------------------------------------------ CIFAR-style


class Net(nn.Module):
    """DeepSpeedExamples' cifar10 ``Net``, shrunk to 8x8 images."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3)
        self.pool = nn.MaxPool2d(2, 2)
        self.fc1 = nn.Linear(4 * 3 * 3, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.conv1(x)))
        x = torch.flatten(x, 1)
        return self.fc2(torch.relu(self.fc1(x)))


CIFAR_SAMPLES, CIFAR_EPOCHS = 38, 2


def cifar_dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    images = torch.randn(CIFAR_SAMPLES, 3, 8, 8, generator=g)
    labels = torch.randint(0, 10, (CIFAR_SAMPLES,), generator=g)
    return TensorDataset(images, labels)


def cifar_loop(stage: int, world: int, rank: int, workdir: str) -> dict[str, Any]:
    import ds_core as deepspeed
    from ds_core import get_accelerator

    path = os.path.join(workdir, f"ds_config_s{stage}.rank{rank}.json")
    with open(path, "w") as f:
        json.dump(stage_config(stage, dataloader_drop_last=True), f)

    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", path])

    torch.manual_seed(0)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    trainset = cifar_dataset()
    model_engine, optimizer, trainloader, __ = deepspeed.initialize(  # noqa: RUF059
        args=args, model=net, model_parameters=parameters, training_data=trainset
    )
    local_device = get_accelerator().device_name(model_engine.local_rank)
    criterion = nn.CrossEntropyLoss()
    losses = []
    for _epoch in range(CIFAR_EPOCHS):
        for _i, data in enumerate(trainloader):
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            losses.append(loss.item())
    return {
        "losses": losses,
        "batches": len(trainloader),
        "state": model_engine.module_state_dict(),
    }


def cifar_reference(world: int) -> dict[str, Any]:
    """DeepSpeed's loader: DistributedSampler(shuffle=True, seed=0), same order each epoch,
    dataloader_drop_last dropping each rank's last short batch."""
    data = cifar_dataset()
    shares = [list(DistributedSampler(data, world, r, shuffle=True, seed=0)) for r in range(world)]
    per_rank = len(shares[0]) // MICRO
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.Adam(net.parameters(), lr=LR)
    criterion = nn.CrossEntropyLoss()
    for _epoch in range(CIFAR_EPOCHS):
        for i in range(per_rank):
            idx = [j for share in shares for j in share[i * MICRO : (i + 1) * MICRO]]
            images, labels = data[idx]
            criterion(net(images), labels).backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)  # DeepSpeed's default clip
            opt.step()
            opt.zero_grad()
    return {"state": net.state_dict(), "batches": per_rank}


# ------------------------------------------------------------------------------ GAN


NZ, DIM, GAN_ITERS = 4, 6, 3
REAL_LABEL, FAKE_LABEL = 1.0, 0.0


class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Sequential(nn.Linear(NZ, 16), nn.ReLU(), nn.Linear(16, DIM), nn.Tanh())

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.main(z)


class Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.Linear(DIM, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1), nn.Sigmoid()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x).view(-1)


def gan_data(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    n = GAN_ITERS * world * MICRO
    return torch.randn(n, DIM, generator=g), torch.randn(n, NZ, generator=g)


def gan_config(stage: int) -> dict[str, Any]:
    cfg = stage_config(stage)
    del cfg["optimizer"]  # the example passes its own optimizers
    return cfg


def gan_loop(stage: int, world: int, rank: int) -> dict[str, Any]:
    """DeepSpeedExamples' gan_deepspeed_train.py loop: two engines over client optimizers,
    the raw modules called and zeroed (``netD(...)``, ``netD.zero_grad()``) as it does."""
    import ds_core as deepspeed

    torch.manual_seed(0)
    netG, netD = Generator(), Discriminator()  # noqa: N806 (the example's names)
    criterion = nn.BCELoss()
    optimizerD = torch.optim.Adam(netD.parameters(), lr=2e-3, betas=(0.5, 0.999))  # noqa: N806
    optimizerG = torch.optim.Adam(netG.parameters(), lr=2e-3, betas=(0.5, 0.999))  # noqa: N806
    model_engineD, optimizerD, _, _ = deepspeed.initialize(  # noqa: N806
        model=netD,
        model_parameters=netD.parameters(),
        optimizer=optimizerD,
        config=gan_config(stage),
    )
    model_engineG, optimizerG, _, _ = deepspeed.initialize(  # noqa: N806
        model=netG,
        model_parameters=netG.parameters(),
        optimizer=optimizerG,
        config=gan_config(stage),
    )
    device = model_engineD.device
    reals, noises = gan_data(world)
    d_losses, g_losses = [], []
    for i in range(GAN_ITERS):
        lo = (i * world + rank) * MICRO
        real, noise = reals[lo : lo + MICRO].to(device), noises[lo : lo + MICRO].to(device)
        # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
        netD.zero_grad()
        label = torch.full((MICRO,), REAL_LABEL, device=device)
        output = netD(real)
        errD_real = criterion(output, label)  # noqa: N806
        model_engineD.backward(errD_real)
        fake = netG(noise)
        label.fill_(FAKE_LABEL)
        output = netD(fake.detach())
        errD_fake = criterion(output, label)  # noqa: N806
        model_engineD.backward(errD_fake)
        errD = errD_real + errD_fake  # noqa: N806
        model_engineD.step()
        # (2) Update G network: maximize log(D(G(z)))
        netG.zero_grad()
        label.fill_(REAL_LABEL)
        output = netD(fake)
        errG = criterion(output, label)  # noqa: N806
        model_engineG.backward(errG)
        model_engineG.step()
        d_losses.append(errD.item())
        g_losses.append(errG.item())
    return {
        "d_losses": d_losses,
        "g_losses": g_losses,
        "G": model_engineG.module_state_dict(),
        "D": model_engineD.module_state_dict(),
    }


def gan_reference(world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    netG, netD = Generator(), Discriminator()  # noqa: N806
    criterion = nn.BCELoss()
    optD = torch.optim.Adam(netD.parameters(), lr=2e-3, betas=(0.5, 0.999))  # noqa: N806
    optG = torch.optim.Adam(netG.parameters(), lr=2e-3, betas=(0.5, 0.999))  # noqa: N806
    reals, noises = gan_data(world)
    width = world * MICRO
    d_losses, g_losses = [], []
    for i in range(GAN_ITERS):
        real, noise = reals[i * width : (i + 1) * width], noises[i * width : (i + 1) * width]
        netD.zero_grad()
        errD_real = criterion(netD(real), torch.full((width,), REAL_LABEL))  # noqa: N806
        errD_real.backward()
        fake = netG(noise)
        errD_fake = criterion(netD(fake.detach()), torch.full((width,), FAKE_LABEL))  # noqa: N806
        errD_fake.backward()
        optD.step()
        netG.zero_grad()
        errG = criterion(netD(fake), torch.full((width,), REAL_LABEL))  # noqa: N806
        errG.backward()
        optG.step()
        d_losses.append((errD_real + errD_fake).item())
        g_losses.append(errG.item())
    return {
        "d_losses": d_losses,
        "g_losses": g_losses,
        "G": netG.state_dict(),
        "D": netD.state_dict(),
    }
