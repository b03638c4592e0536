"""DeepSpeedExamples training/HelloDeepSpeed/train_bert_ds.py, transcribed.

Source: github.com/deepspeedai/DeepSpeedExamples, training/HelloDeepSpeed/train_bert_ds.py at
45b4b7156c8794a3452a5a7d03dbd8d797068569. A RoBERTa masked-language model built from a
config (the program's own ``create_model``, its 50,265-token vocabulary), its DeepSpeed config
(ZeRO stage 1 with ``offload_optimizer`` on the CPU), its loop and its ``save_checkpoint``. Run
with small widths (``num_layers=2, num_heads=2, ff_dim=32, h_dim=16, dropout=0.0,
max_seq_length=16, batch_size=2, num_iterations=5``); departures are marked ``# CHANGED``.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import string
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any, ClassVar, TypeVar

import deepspeed  # resolved to ds_core by tests/compat/clients.deepspeed_shim
import numpy as np
import torch
import torch.nn as nn
from deepspeed.accelerator import get_accelerator
from torch.utils.data import DataLoader, Dataset
from transformers.models.roberta import RobertaConfig, RobertaModel
from transformers.models.roberta.modeling_roberta import RobertaLMHead, RobertaPreTrainedModel

# CHANGED: loguru, pytz, sh, fire, datasets and tensorboard are not installed: the standard
# logging module, no time zone, no git hash files, a direct call of ``train``, local texts
# and no SummaryWriter (each marked where it is used).
logger = logging.getLogger("train_bert_ds")


def is_rank_0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log messages for specified ranks only"""
    my_rank = int(os.environ.get("RANK", "0"))
    if my_rank in (ranks or []):
        if level == logging.INFO:
            logger.info(f"[Rank {my_rank}] {message}")
        if level == logging.ERROR:
            logger.error(f"[Rank {my_rank}] {message}")
        if level == logging.DEBUG:
            logger.debug(f"[Rank {my_rank}] {message}")


def collate_function(
    batch: list[tuple[list[int], list[int]]], pad_token_id: int
) -> dict[str, torch.Tensor]:
    """Batch masked token indices and labels, padded to the batch's longest."""
    max_length = max(len(token_ids) for token_ids, _ in batch)
    padded_token_ids = [
        token_ids + [pad_token_id for _ in range(0, max_length - len(token_ids))]
        for token_ids, _ in batch
    ]
    padded_labels = [
        labels + [pad_token_id for _ in range(0, max_length - len(labels))] for _, labels in batch
    ]
    src_tokens = torch.LongTensor(padded_token_ids)
    tgt_tokens = torch.LongTensor(padded_labels)
    attention_mask = src_tokens.ne(pad_token_id).type_as(src_tokens)
    return {"src_tokens": src_tokens, "tgt_tokens": tgt_tokens, "attention_mask": attention_mask}


def masking_function(
    text: str,
    tokenizer: Any,
    mask_prob: float,
    random_replace_prob: float,
    unmask_replace_prob: float,
    max_length: int,
) -> tuple[list[int], list[int]]:
    """Randomly mask word pieces of ``text`` for MLM training (the program's BERT masking)."""
    tokenized_ids = (
        [tokenizer.bos_token_id]  # noqa: RUF005 (the program's form)
        + tokenizer.encode(
            text, add_special_tokens=False, truncation=True, max_length=max_length - 2
        )
        + [tokenizer.eos_token_id]
    )
    seq_len = len(tokenized_ids)
    tokenized_ids = np.array(tokenized_ids)
    subword_mask = np.full(len(tokenized_ids), False)
    low = 1
    high = len(subword_mask) - 1
    mask_choices = np.arange(low, high)
    num_subwords_to_mask = max(int((mask_prob * (high - low)) + np.random.rand()), 1)
    subword_mask[np.random.choice(mask_choices, num_subwords_to_mask, replace=False)] = True
    labels = np.full(seq_len, tokenizer.pad_token_id)
    labels[subword_mask] = tokenized_ids[subword_mask]
    tokenized_ids[subword_mask] = tokenizer.mask_token_id
    rand_or_unmask_prob = random_replace_prob + unmask_replace_prob
    if rand_or_unmask_prob > 0:
        rand_or_unmask = subword_mask & (np.random.rand(len(tokenized_ids)) < rand_or_unmask_prob)
        if random_replace_prob == 0:
            unmask, rand_mask = rand_or_unmask, None
        elif unmask_replace_prob == 0:
            unmask, rand_mask = None, rand_or_unmask
        else:
            unmask_prob = unmask_replace_prob / rand_or_unmask_prob
            decision = np.random.rand(len(tokenized_ids)) < unmask_prob
            unmask = rand_or_unmask & decision
            rand_mask = rand_or_unmask & (~decision)
        if unmask is not None:
            tokenized_ids[unmask] = labels[unmask]
        if rand_mask is not None:
            weights = np.ones(tokenizer.vocab_size)
            weights[tokenizer.all_special_ids] = 0
            probs = weights / weights.sum()
            num_rand = rand_mask.sum()
            tokenized_ids[rand_mask] = np.random.choice(tokenizer.vocab_size, num_rand, p=probs)
    return tokenized_ids.tolist(), labels.tolist()


class WikiTextMLMDataset(Dataset[tuple[list[int], list[int]]]):
    """A map-style dataset over records with a ``text``, masked on access."""

    def __init__(
        self, dataset: Any, masking_function: Callable[[str], tuple[list[int], list[int]]]
    ) -> None:
        self.dataset = dataset
        self.masking_function = masking_function

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx: int) -> tuple[list[int], list[int]]:
        tokens, labels = self.masking_function(self.dataset[idx]["text"])
        return (tokens, labels)


T = TypeVar("T")


class InfiniteIterator:
    def __init__(self, iterable: Iterable[T]) -> None:
        self._iterable = iterable
        self._iterator = iter(self._iterable)

    def __iter__(self) -> InfiniteIterator:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._iterator)
        except StopIteration:
            self._iterator = iter(self._iterable)
            return next(self._iterator)


class LocalTokenizer:
    """CHANGED: in place of AutoTokenizer.from_pretrained("roberta-base") (a download): roberta's
    special ids and vocabulary size; a text is its token ids written out."""

    bos_token_id, pad_token_id, eos_token_id, unk_token_id, mask_token_id = 0, 1, 2, 3, 50264
    vocab_size = 50265
    all_special_ids: ClassVar[list[int]] = [0, 1, 2, 3, 50264]

    def encode(
        self, text: str, add_special_tokens: bool, truncation: bool, max_length: int
    ) -> list[int]:
        ids = [int(word) for word in text.split()]
        return ids[:max_length] if truncation else ids


def local_texts(n: int = 16) -> list[dict[str, str]]:
    """CHANGED: in place of datasets.load_dataset("wikitext", "wikitext-2-v1") (a download):
    records of 6-20 random non-special token ids."""
    g = torch.Generator().manual_seed(7)
    texts = []
    for _ in range(n):
        length = int(torch.randint(6, 21, (), generator=g))
        ids = torch.randint(4, 50264, (length,), generator=g).tolist()
        texts.append({"text": " ".join(str(i) for i in ids)})
    return texts


def create_data_iterator(
    mask_prob: float,
    random_replace_prob: float,
    unmask_replace_prob: float,
    batch_size: int,
    max_seq_length: int = 512,
    tokenizer: str = "roberta-base",
) -> InfiniteIterator:
    wikitext_dataset = local_texts()  # CHANGED: local texts (see local_texts)
    tok = LocalTokenizer()  # CHANGED: local tokenizer (see LocalTokenizer)
    masking_function_partial = partial(
        masking_function,
        tokenizer=tok,
        mask_prob=mask_prob,
        random_replace_prob=random_replace_prob,
        unmask_replace_prob=unmask_replace_prob,
        max_length=max_seq_length,
    )
    dataset = WikiTextMLMDataset(wikitext_dataset, masking_function_partial)
    collate_fn_partial = partial(collate_function, pad_token_id=tok.pad_token_id)
    dataloader = DataLoader(
        dataset, batch_size=batch_size, shuffle=True, collate_fn=collate_fn_partial
    )
    return InfiniteIterator(dataloader)


class RobertaLMHeadWithMaskedPredict(RobertaLMHead):
    def __init__(self, config: RobertaConfig, embedding_weight: torch.Tensor | None = None) -> None:
        super().__init__(config)
        if embedding_weight is not None:
            self.decoder.weight = embedding_weight

    def forward(  # type: ignore[override]
        self,
        features: torch.Tensor,
        masked_token_indices: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Run the head on the masked positions only."""
        if masked_token_indices is not None:
            features = torch.index_select(
                features.view(-1, features.shape[-1]), 0, masked_token_indices
            )
        return super().forward(features)


class RobertaMLMModel(RobertaPreTrainedModel):
    def __init__(self, config: RobertaConfig, encoder: RobertaModel) -> None:
        super().__init__(config)
        self.encoder = encoder
        self.lm_head = RobertaLMHeadWithMaskedPredict(
            config, self.encoder.embeddings.word_embeddings.weight
        )
        self.lm_head.apply(self._init_weights)

    def forward(  # type: ignore[override]
        self, src_tokens: torch.Tensor, attention_mask: torch.Tensor, tgt_tokens: torch.Tensor
    ) -> torch.Tensor:
        """The MLM loss."""
        sequence_output, *_ = self.encoder(
            input_ids=src_tokens, attention_mask=attention_mask, return_dict=False
        )
        pad_token_id = self.config.pad_token_id
        masked_token_indexes = torch.nonzero((tgt_tokens != pad_token_id).view(-1)).view(-1)
        prediction_scores = self.lm_head(sequence_output, masked_token_indexes)
        target = torch.index_select(tgt_tokens.view(-1), 0, masked_token_indexes)
        loss_fct = nn.CrossEntropyLoss(ignore_index=-1)
        return loss_fct(prediction_scores.view(-1, self.config.vocab_size), target)


def create_model(
    num_layers: int, num_heads: int, ff_dim: int, h_dim: int, dropout: float
) -> RobertaMLMModel:
    roberta_config_dict = {
        "attention_probs_dropout_prob": dropout,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "hidden_act": "gelu",
        "hidden_dropout_prob": dropout,
        "hidden_size": h_dim,
        "initializer_range": 0.02,
        "intermediate_size": ff_dim,
        "layer_norm_eps": 1e-05,
        "max_position_embeddings": 514,
        "model_type": "roberta",
        "num_attention_heads": num_heads,
        "num_hidden_layers": num_layers,
        "pad_token_id": 1,
        "type_vocab_size": 1,
        "vocab_size": 50265,
    }
    roberta_config = RobertaConfig.from_dict(roberta_config_dict)
    roberta_encoder = RobertaModel(roberta_config)
    return RobertaMLMModel(roberta_config, roberta_encoder)


def get_unique_identifier(length: int = 8) -> str:
    alphabet = string.ascii_lowercase + string.digits
    return "".join(alphabet[ix] for ix in np.random.choice(len(alphabet), length))


def create_experiment_dir(
    checkpoint_dir: pathlib.Path, all_arguments: dict[str, Any]
) -> pathlib.Path:
    # CHANGED: no time stamp (pytz is not installed, and the ranks' clocks may name different
    # seconds) and no random identifier (the program's ranks draw it from unseeded numpy), so
    # every rank names the same directory: ds_core's save_checkpoint checks that its ranks
    # agree on it. No githash.log / gitdiff.log (sh is not installed).
    expname = "bert_pretrain.corpus"
    exp_dir = checkpoint_dir / expname
    if not is_rank_0():
        return exp_dir
    exp_dir.mkdir(exist_ok=False)
    with (exp_dir / "hparams.json").open("w") as handle:
        json.dump(obj=all_arguments, fp=handle, indent=2)
    tb_dir = exp_dir / "tb_dir"
    tb_dir.mkdir(exist_ok=False)
    return exp_dir


def train(
    checkpoint_dir: str | None = None,
    load_checkpoint_dir: str | None = None,
    mask_prob: float = 0.15,
    random_replace_prob: float = 0.1,
    unmask_replace_prob: float = 0.1,
    max_seq_length: int = 512,
    tokenizer: str = "roberta-base",
    num_layers: int = 6,
    num_heads: int = 8,
    ff_dim: int = 512,
    h_dim: int = 256,
    dropout: float = 0.1,
    batch_size: int = 8,
    num_iterations: int = 10000,
    checkpoint_every: int = 1000,
    log_every: int = 10,
    local_rank: int = -1,
    dtype: str = "bf16",
) -> dict[str, Any]:
    device = (
        torch.device(get_accelerator().device_name(), local_rank)
        if (local_rank > -1) and get_accelerator().is_available()
        else torch.device("cpu")
    )
    assert checkpoint_dir is not None and load_checkpoint_dir is None  # CHANGED: new runs only
    checkpoint_path = pathlib.Path(checkpoint_dir)
    checkpoint_path.mkdir(exist_ok=True)
    all_arguments = {
        "mask_prob": mask_prob,
        "random_replace_prob": random_replace_prob,
        "unmask_replace_prob": unmask_replace_prob,
        "max_seq_length": max_seq_length,
        "tokenizer": tokenizer,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "ff_dim": ff_dim,
        "h_dim": h_dim,
        "dropout": dropout,
        "batch_size": batch_size,
        "num_iterations": num_iterations,
        "checkpoint_every": checkpoint_every,
    }
    exp_dir = create_experiment_dir(checkpoint_path, all_arguments)
    log_dist(f"Experiment Directory created at {exp_dir}", ranks=[0], level=logging.INFO)
    # CHANGED: no SummaryWriter (tensorboard is not installed).

    log_dist("Creating Datasets", ranks=[0], level=logging.INFO)
    data_iterator = create_data_iterator(
        mask_prob=mask_prob,
        random_replace_prob=random_replace_prob,
        unmask_replace_prob=unmask_replace_prob,
        tokenizer=tokenizer,
        max_seq_length=max_seq_length,
        batch_size=batch_size,
    )
    log_dist("Creating Model", ranks=[0], level=logging.INFO)
    torch.manual_seed(0)  # CHANGED: seeded, so every rank and the twin start alike
    model = create_model(
        num_layers=num_layers, num_heads=num_heads, ff_dim=ff_dim, h_dim=h_dim, dropout=dropout
    )
    log_dist("Creating DeepSpeed engine", ranks=[0], level=logging.INFO)
    assert dtype in ("fp16", "bf16", "fp32")  # CHANGED: fp32 allowed, for the 1e-5 comparison
    ds_config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": batch_size,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
        dtype: {"enabled": True},
        "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
    }
    if dtype == "fp32":  # CHANGED: DeepSpeed has no "fp32" section; fp32 is neither enabled
        del ds_config["fp32"]
    model, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config
    )
    log_dist("DeepSpeed engine created", ranks=[0], level=logging.INFO)
    start_step = 1
    n_params = sum(p.numel() for p in model.parameters())
    log_dist(f"Total number of model parameters: {n_params:,d}", ranks=[0], level=logging.INFO)
    model.train()
    losses = []
    batches = []  # CHANGED: recorded for the twin
    for step, batch in enumerate(data_iterator, start=start_step):
        if step >= num_iterations:
            break
        for key, value in batch.items():
            batch[key] = value.to(device)
        loss = model(**batch)
        model.backward(loss)
        model.step()
        losses.append(loss.item())
        batches.append(batch)
        if step % log_every == 0:
            log_dist(f"Loss: {np.mean(losses):.4f}", ranks=[0], level=logging.INFO)
        if step % checkpoint_every == 0:
            model.save_checkpoint(save_dir=exp_dir, client_state={"checkpoint_step": step})
    if step % checkpoint_every != 0:
        model.save_checkpoint(save_dir=exp_dir, client_state={"checkpoint_step": step})
        log_dist(f"Saved model to {exp_dir}", ranks=[0], level=logging.INFO)
    # CHANGED: returns what the twin compares (the program returns exp_dir).
    saved = sorted(
        str(p.relative_to(exp_dir)) for p in pathlib.Path(exp_dir).rglob("*") if p.is_file()
    )
    return {
        "losses": losses,
        "batches": batches,
        "state": model.module_state_dict(),
        "saved": saved,
    }


KWARGS: dict[str, Any] = dict(
    num_layers=2,
    num_heads=2,
    ff_dim=32,
    h_dim=16,
    dropout=0.0,
    max_seq_length=16,
    batch_size=2,
    num_iterations=5,
    dtype="fp32",
)


def run(world: int, rank: int, outdir: str) -> dict[str, Any]:
    np.random.seed(
        rank
    )  # CHANGED: numpy's masking draws seeded (per rank, as unseeded ranks differ)
    # CHANGED: train() called directly (fire is not installed), with the --local_rank that
    # DeepSpeed's launcher passes.
    return train(
        checkpoint_dir=os.path.join(outdir, "checkpoints"),
        local_rank=int(os.environ["LOCAL_RANK"]),
        **KWARGS,
    )


def reference(world: int, results: list[dict[str, Any]]) -> dict[str, Any]:
    """Plain PyTorch: the same model, Adam at 1e-4 (DeepSpeed's CPU Adam, no weight decay),
    DeepSpeed's default clipping at 1.0, on the ranks' batches."""
    from tests.compat.clients import _twin

    torch.manual_seed(0)
    model = create_model(2, 2, 32, 16, 0.0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    losses: list[list[float]] = [[] for _ in range(world)]
    for step in range(len(results[0]["batches"])):
        step_losses = _twin.dp_backward(lambda b: model(**b), [r["batches"][step] for r in results])
        _twin.clip(model, 1.0)
        opt.step()
        opt.zero_grad()
        for rank, value in enumerate(step_losses):
            losses[rank].append(value)
    return {"losses": losses, "state": model.state_dict()}
