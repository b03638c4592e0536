"""DeepSpeedExamples training/gan/gan_deepspeed_train.py (with gan_model.py and utils.py),
transcribed.

Source: github.com/deepspeedai/DeepSpeedExamples, training/gan/{gan_deepspeed_train.py,
gan_model.py, utils.py, gan_deepspeed_config.json} at 45b4b7156c8794a3452a5a7d03dbd8d797068569.
The DCGAN generator and discriminator (64x64 images), two engines over client Adam optimizers,
the raw modules called and zeroed as the program does. Run with ``--dataset fake`` and small
widths (``--nz 8 --ngf 4 --ndf 4 --batchSize 4``); departures are marked ``# CHANGED``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from typing import Any

import deepspeed  # resolved to ds_core by tests/compat/clients.deepspeed_shim
import numpy as np
import torch
import torch.nn as nn
import torch.utils.data
from deepspeed.accelerator import get_accelerator  # CHANGED: for the torch.cuda calls below
from torch.utils.data import TensorDataset

# ------------------------------------------------------------------ gan_model.py


def weights_init(m: nn.Module) -> None:
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        nn.init.normal_(m.weight.data, 0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        nn.init.normal_(m.weight.data, 1.0, 0.02)
        nn.init.constant_(m.bias.data, 0)


class Generator(nn.Module):
    def __init__(self, ngpu: int, ngf: int, nc: int, nz: int) -> None:
        super().__init__()
        self.ngpu = ngpu
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 8, 4, 1, 0, bias=False),
            nn.BatchNorm2d(ngf * 8),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 8, ngf * 4, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf * 4),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf * 2),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False),
            nn.Tanh(),
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.is_cuda and self.ngpu > 1:
            return nn.parallel.data_parallel(self.main, input, range(self.ngpu))
        return self.main(input)


class Discriminator(nn.Module):
    def __init__(self, ngpu: int, ndf: int, nc: int) -> None:
        super().__init__()
        self.ngpu = ngpu
        self.main = nn.Sequential(
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 2),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, ndf * 4, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 4),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 4, ndf * 8, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 8),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 8, 1, 4, 1, 0, bias=False),
            nn.Sigmoid(),
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.is_cuda and self.ngpu > 1:
            output = nn.parallel.data_parallel(self.main, input, range(self.ngpu))
        else:
            output = self.main(input)
        return output.view(-1, 1).squeeze(1)


# ------------------------------------------------------------------ utils.py


def get_argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="GAN")
    parser.add_argument("--backend", type=str, default="nccl", help="distributed backend")
    parser.add_argument("--dataset", required=True, help="cifar10 | lsun | mnist | ... | fake")
    parser.add_argument("--dataroot", type=str, required=False, default="/data/celeba/")
    parser.add_argument("--workers", type=int, help="number of data loading workers", default=16)
    parser.add_argument("--batchSize", type=int, default=64, help="input batch size")
    parser.add_argument("--imageSize", type=int, default=64, help="image height / width")
    parser.add_argument("--nz", type=int, default=100, help="size of the latent z vector")
    parser.add_argument("--ngf", type=int, default=64)
    parser.add_argument("--ndf", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=1, help="number of epochs to train for")
    parser.add_argument("--lr", type=float, default=0.0002, help="learning rate")
    parser.add_argument("--beta1", type=float, default=0.5, help="beta1 for adam")
    parser.add_argument("--cuda", action="store_true", help="enables cuda")
    parser.add_argument("--ngpu", type=int, default=16, help="number of GPUs to use")
    parser.add_argument("--netG", default="", help="path to netG (to continue training)")
    parser.add_argument("--netD", default="", help="path to netD (to continue training)")
    parser.add_argument("--outf", default="./gan_output", help="output folder")
    parser.add_argument("--manualSeed", type=int, default=999, help="manual seed")
    parser.add_argument("--classes", default="bedroom", help="lsun classes")
    parser.add_argument("--tensorboard_path", default="./runs/deepspeed", help="tensorboard dir")
    parser.add_argument("--local_rank", type=int, default=-1, help="local_rank")
    return parser


def set_seed(value: int) -> None:
    print("Random Seed: ", value)
    random.seed(value)
    torch.manual_seed(value)
    get_accelerator().manual_seed_all(value)  # CHANGED: torch.cuda's, through the accelerator
    np.random.seed(value)


def create_folder(folder: str) -> None:
    try:
        os.makedirs(folder)
    except OSError:
        pass


# ------------------------------------------------------------------ gan_deepspeed_train.py

#: CHANGED: torchvision's FakeData (the program's ``--dataset fake``) is not installed: random
#: images of its shape in [0, 1] (what ToTensor gives), 2 iterations of ``--batchSize``.
FAKE_SAMPLES = 8


def get_dataset(args: argparse.Namespace) -> tuple[TensorDataset, int]:
    if str(args.dataset).lower() != "fake":
        raise ValueError("CHANGED: only --dataset fake is transcribed (the others download)")
    images = torch.rand(FAKE_SAMPLES, 3, args.imageSize, args.imageSize)
    dataset = TensorDataset(images, torch.zeros(FAKE_SAMPLES, dtype=torch.long))
    nc = 3
    return dataset, nc


def train(args: argparse.Namespace) -> dict[str, Any]:
    # CHANGED: SummaryWriter dropped (tensorboard is not installed).
    create_folder(args.outf)
    set_seed(args.manualSeed)
    # CHANGED: cudnn.benchmark dropped (no CUDA).
    dataset, nc = get_dataset(args)
    dataloader = torch.utils.data.DataLoader(
        dataset, batch_size=args.batchSize, shuffle=True, num_workers=int(args.workers)
    )
    # CHANGED: torch.cuda.set_device and torch.device("cuda", ...) through the accelerator
    # (the selected backend's device: the CPU, or sim's device local_rank).
    get_accelerator().set_device(args.local_rank)
    device = torch.device(get_accelerator().device_name(args.local_rank))
    ngpu = 0
    nz = int(args.nz)
    ngf = int(args.ngf)
    ndf = int(args.ndf)

    netG = Generator(ngpu, ngf, nc, nz).to(device)  # noqa: N806 (the program's names)
    netG.apply(weights_init)
    if args.netG != "":
        netG.load_state_dict(torch.load(args.netG))
    netD = Discriminator(ngpu, ndf, nc).to(device)  # noqa: N806
    netD.apply(weights_init)
    if args.netD != "":
        netD.load_state_dict(torch.load(args.netD))

    criterion = nn.BCELoss()
    fixed_noise = torch.randn(args.batchSize, nz, 1, 1, device=device)
    real_label = 1
    fake_label = 0

    # setup optimizer
    optimizerD = torch.optim.Adam(netD.parameters(), lr=args.lr, betas=(args.beta1, 0.999))  # noqa: N806
    optimizerG = torch.optim.Adam(netG.parameters(), lr=args.lr, betas=(args.beta1, 0.999))  # noqa: N806
    model_engineD, optimizerD, _, _ = deepspeed.initialize(  # noqa: N806
        args=args, model=netD, model_parameters=netD.parameters(), optimizer=optimizerD
    )
    model_engineG, optimizerG, _, _ = deepspeed.initialize(  # noqa: N806
        args=args, model=netG, model_parameters=netG.parameters(), optimizer=optimizerG
    )

    # CHANGED: torch.cuda.synchronize() and the wall-clock timing dropped (no CUDA).
    d_losses, g_losses, reals = [], [], []  # CHANGED: recorded for the twin
    # CHANGED: the initial weights recorded for the twin: weights_init draws them with the
    # device's generator (a "cuda" device's in the program), which the host twin cannot replay.
    init = {"G": clone_state(netG), "D": clone_state(netD)}
    for epoch in range(args.epochs):
        for i, data in enumerate(dataloader, 0):
            # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
            netD.zero_grad()
            real = data[0].to(device)
            batch_size = real.size(0)
            label = torch.full((batch_size,), real_label, dtype=real.dtype, device=device)
            output = netD(real)
            errD_real = criterion(output, label)  # noqa: N806
            model_engineD.backward(errD_real)
            D_x = output.mean().item()  # noqa: N806
            noise = torch.randn(batch_size, nz, 1, 1, device=device)
            fake = netG(noise)
            label.fill_(fake_label)
            output = netD(fake.detach())
            errD_fake = criterion(output, label)  # noqa: N806
            model_engineD.backward(errD_fake)
            D_G_z1 = output.mean().item()  # noqa: N806
            errD = errD_real + errD_fake  # noqa: N806
            model_engineD.step()

            # (2) Update G network: maximize log(D(G(z)))
            netG.zero_grad()
            label.fill_(real_label)  # fake labels are real for generator cost
            output = netD(fake)
            errG = criterion(output, label)  # noqa: N806
            model_engineG.backward(errG)
            D_G_z2 = output.mean().item()  # noqa: N806
            model_engineG.step()

            print(
                f"[{epoch}/{args.epochs}][{i}/{len(dataloader)}] Loss_D: {errD.item():.4f} "
                f"Loss_G: {errG.item():.4f} D(x): {D_x:.4f} D(G(z)): {D_G_z1:.4f} / {D_G_z2:.4f}"
            )
            # CHANGED: writer.add_scalar and vutils.save_image dropped (tensorboard and
            # torchvision are not installed); the fixed-noise sample is still drawn.
            if i % 100 == 0:
                fake = netG(fixed_noise)
            d_losses.append(errD.item())
            g_losses.append(errG.item())
            reals.append((real, noise))
    return {
        "d_losses": d_losses,
        "g_losses": g_losses,
        "batches": reals,
        "G": model_engineG.module_state_dict(),
        "D": model_engineD.module_state_dict(),
        "init": init,
    }


def clone_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """CHANGED (added): a copy of ``module``'s state, for the twin."""
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def config() -> dict[str, Any]:
    """gan_deepspeed_config.json. CHANGED: ``train_batch_size`` 64 -> ``--batchSize`` x 2
    ranks (the file's value is for its own launch)."""
    return {
        "train_batch_size": 8,
        "optimizer": {
            "type": "Adam",
            "params": {"lr": 0.0002, "betas": [0.5, 0.999], "eps": 1e-8},
        },
        "steps_per_print": 10,
    }


def run(world: int, rank: int, outdir: str) -> dict[str, Any]:
    path = os.path.join(outdir, f"gan_deepspeed_config.rank{rank}.json")
    with open(path, "w") as f:
        json.dump(config(), f)
    parser = get_argument_parser()
    parser = deepspeed.add_config_arguments(parser)
    argv = ["--dataset", "fake", "--batchSize", "4", "--nz", "8", "--ngf", "4", "--ndf", "4"]
    argv += ["--workers", "0", "--outf", os.path.join(outdir, "gan_output")]
    argv += ["--deepspeed", "--deepspeed_config", path]
    argv += ["--local_rank", os.environ["LOCAL_RANK"]]  # what DeepSpeed's launcher passes
    args = parser.parse_args(argv)  # CHANGED: the arguments come from the caller
    return train(args)


def reference(world: int, results: list[dict[str, Any]]) -> dict[str, Any]:
    """Plain PyTorch (clipping at 1.0: DeepSpeed's default ``gradient_clipping``, which the
    engines apply to the client optimizers too) on one rank's batches, from the program's
    initial weights: every rank draws the same weights, batches and noise (the program seeds
    each rank alike and uses a plain DataLoader), so averaging the ranks' gradients changes
    nothing."""
    for r in results[1:]:
        for (a, na), (b, nb) in zip(r["batches"], results[0]["batches"], strict=True):
            assert torch.equal(a, b) and torch.equal(na, nb)
    for r in results[1:]:  # every rank seeds alike (set_seed(999)), so starts alike
        for part in ("G", "D"):
            for key, value in r["init"][part].items():
                assert torch.equal(value, results[0]["init"][part][key]), (part, key)
    netG = Generator(0, 4, 3, 8)  # noqa: N806
    netG.load_state_dict(results[0]["init"]["G"])
    netD = Discriminator(0, 4, 3)  # noqa: N806
    netD.load_state_dict(results[0]["init"]["D"])
    criterion = nn.BCELoss()
    optD = torch.optim.Adam(netD.parameters(), lr=0.0002, betas=(0.5, 0.999))  # noqa: N806
    optG = torch.optim.Adam(netG.parameters(), lr=0.0002, betas=(0.5, 0.999))  # noqa: N806
    d_losses, g_losses = [], []
    for real, noise in results[0]["batches"]:
        n = real.size(0)
        netD.zero_grad()
        errD_real = criterion(netD(real), torch.ones(n))  # noqa: N806
        errD_real.backward()
        fake = netG(noise)
        errD_fake = criterion(netD(fake.detach()), torch.zeros(n))  # noqa: N806
        errD_fake.backward()
        torch.nn.utils.clip_grad_norm_(netD.parameters(), 1.0)  # DeepSpeed's default clip
        optD.step()
        netG.zero_grad()
        errG = criterion(netD(fake), torch.ones(n))  # noqa: N806
        errG.backward()
        torch.nn.utils.clip_grad_norm_(netG.parameters(), 1.0)
        optG.step()
        d_losses.append((errD_real + errD_fake).item())
        g_losses.append(errG.item())
    return {
        "d_losses": d_losses,
        "g_losses": g_losses,
        "G": netG.state_dict(),
        "D": netD.state_dict(),
    }
