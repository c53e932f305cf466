"""Train a timm model (the SC zoo or any other) on the paper's data sets or any timm data set.

Built from timm's own parts: ``timm.data`` transforms and prefetcher, ``create_optimizer_v2``,
``create_scheduler_v2``, ``timm.task.ClassificationTask`` and its evaluator, ``CheckpointSaver``,
``update_summary`` and timm's distributed helpers. Flags carry timm's ``train.py`` names, and
``-c CONFIG.yaml`` sets defaults from a preset (``scripts/configs/``).

Outputs under ``<output>/<experiment>/``: ``args.yaml``, ``summary.csv`` (one row per epoch: its training loss,
``train_seconds`` (the seconds the epoch's training and validation ran, summed over the stretches of a resumed
epoch, so pauses and stops do not count), the validation metrics and ``lr``: as timm's ``train.py`` records it, the
optimizer's rate after the epoch's updates, before the per-epoch step of the schedule, so a per-update schedule's rate
at the epoch's end and a per-epoch schedule's rate through the epoch),
``last.pth.tar``, ``model_best.pth.tar``, ``checkpoint-<epoch>.pth.tar``, ``epoch-<N>.pth.tar`` after each
``--keep-epochs N`` and, during an epoch,
``recovery-<epoch>-<batch>.pth.tar`` every ``--recovery-interval`` batches.

Resuming: ``--resume <output>/<experiment>`` (the folder) continues from the most advanced checkpoint
in it, mid-epoch if a recovery checkpoint is newer than the last epoch's, and ends after the same
``--epochs``. The order of the training images is a function of ``--seed`` and the epoch, and the
random state of each step is reseeded from (seed, rank, epoch, batch), so a resumed run computes what
the uninterrupted run would have (augmentation, off by default, draws in loader workers and is
reproduced only at epoch boundaries).

Examples::

    python scripts/train.py -c scripts/configs/mnist_scnn.yaml --model scnn_p_rs_7 --data-dir DATA/mnist
    python scripts/train.py --model scnn_baseline_3 --dataset sortconv/mnist --data-dir DATA/mnist \\
        --epochs 1 --train-samples 2000 --val-samples 1000 --experiment demo-baseline
    torchrun --nproc_per_node 2 scripts/train.py --device cpu ...      # DDP over gloo on CPU
"""
import argparse
import glob
import logging
import os
import shutil
import time
from collections import OrderedDict
from contextlib import nullcontext
from datetime import datetime, timedelta
from functools import partial
from typing import List

import torch
import torch.distributed as dist
import yaml
from timm import utils
from timm.data import create_loader
from timm.models import create_model, safe_model_name
from timm.optim import create_optimizer_v2, optimizer_kwargs
from timm.scheduler import create_scheduler_v2, scheduler_kwargs
from timm.task import (
    ClassificationTask,
    evaluation_sample_limit,
    resume_task_checkpoint,
)
from timm.utils import load_checkpoint_metadata

from .. import models  # noqa: F401  (registers the SC models with timm)
from ..data import cap_samples, create_dataset, create_train_loader, is_sortconv_dataset, resolve_data_config
from . import CommandError, KeyValueArgs, add_data_args, add_input_args, check_input_channels, key_value, run
from .validate import check_image_folder

_logger = logging.getLogger("train")

config_parser = argparse.ArgumentParser(description="Training config", add_help=False)
config_parser.add_argument("-c", "--config", default="", type=str, metavar="FILE",
                           help="YAML file of argument defaults (keys are the options' long names with '_')")


def build_parser() -> argparse.ArgumentParser:
    """The command line of this tool; a fresh parser each call, since a preset (``-c``) sets its defaults."""
    parser = argparse.ArgumentParser(
        description="Train a timm / timm-sortconv model; -c CONFIG.yaml sets defaults from a preset (scripts/configs/)")
    group = parser.add_argument_group("Dataset")
    add_data_args(group)
    group.add_argument("--train-split", metavar="NAME", default="train", help="training split (default: train)")
    group.add_argument("--val-split", metavar="NAME", default="validation",
                       help="validation split (default: validation); empty for none")
    group.add_argument("--train-samples", type=int, default=None, metavar="N",
                       help="train on a seeded random N-image slice of the training split")
    group.add_argument("--val-samples", type=int, default=None, metavar="N",
                       help="validate on a seeded random N-image slice of the validation split")

    group = parser.add_argument_group("Model")
    group.add_argument("--model", default="scnn_p_rs_7", type=str, metavar="MODEL",
                       help="model name (default: scnn_p_rs_7)")
    group.add_argument("--pretrained", action="store_true", default=False, help="start from pretrained weights")
    group.add_argument("--initial-checkpoint", default="", type=str, metavar="PATH", help="initialise from this checkpoint")
    group.add_argument("--resume", default="", type=str, metavar="PATH",
                       help="resume from a checkpoint file, or from the most advanced checkpoint in a run folder")
    group.add_argument("--no-resume-opt", action="store_true", default=False, help="do not restore the optimizer state")
    add_input_args(group)
    group.add_argument("--gp", default=None, type=str, metavar="POOL", help="global pool type (model default if unset)")
    group.add_argument("--img-size", type=int, default=None, metavar="N", help="image size (model default if unset)")
    group.add_argument("-b", "--batch-size", type=int, default=100, metavar="N",
                       help="batch size per process (default: 100)")
    group.add_argument("-vb", "--validation-batch-size", type=int, default=None, metavar="N", help="validation batch size")
    group.add_argument("--channels-last", action="store_true", default=False, help="channels_last memory layout")
    group.add_argument("--grad-checkpointing", action="store_true", default=False, help="gradient checkpointing")
    group.add_argument("--model-kwargs", nargs="*", default={}, action=KeyValueArgs, type=key_value, metavar="KEY=VALUE",
                       help="extra create_model arguments, e.g. sampling=polar sorting=ring")
    group.add_argument("--torchcompile", "--torch-compile", nargs="?", type=str, default=None, const="inductor",
                       help="torch.compile the model with this backend (default: inductor)")
    group.add_argument("--torchcompile-mode", type=str, default=None,
                       help="torch.compile mode, e.g. reduce-overhead (CUDA graphs: the fastest on a GPU)")

    group = parser.add_argument_group("Optimizer")
    group.add_argument("--opt", default="adam", type=str, metavar="OPTIMIZER", help="optimizer (default: adam)")
    group.add_argument("--opt-eps", default=None, type=float, metavar="EPSILON", help="optimizer epsilon")
    group.add_argument("--opt-betas", default=None, type=float, nargs="+", metavar="BETA", help="optimizer betas")
    group.add_argument("--momentum", type=float, default=0.9, metavar="M", help="momentum (default: 0.9)")
    group.add_argument("--weight-decay", type=float, default=0.0, help="weight decay (default: 0)")
    group.add_argument("--clip-grad", type=float, default=None, metavar="NORM", help="clip gradients (default: off)")
    group.add_argument("--clip-mode", type=str, default="norm", help='clipping mode: "norm", "value" or "agc"')
    group.add_argument("--opt-kwargs", nargs="*", default={}, action=KeyValueArgs, type=key_value, metavar="KEY=VALUE")

    group = parser.add_argument_group("Learning rate schedule")
    group.add_argument("--sched", type=str, default="step", metavar="SCHEDULER",
                       help="schedule (default: step); cosine, multistep, constant, ... as timm")
    group.add_argument("--sched-on-updates", action="store_true", default=False,
                       help="step the schedule after every update instead of every epoch")
    group.add_argument("--lr", type=float, default=1e-4, metavar="LR", help="learning rate (default: 1e-4)")
    group.add_argument("--epochs", type=int, default=100, metavar="N", help="epochs (default: 100)")
    group.add_argument("--decay-epochs", type=float, default=10, metavar="N", help="step decay interval (default: 10)")
    group.add_argument("--decay-rate", "--dr", type=float, default=0.8, metavar="RATE",
                       help="step decay factor (default: 0.8)")
    group.add_argument("--decay-milestones", default=[30, 60], type=int, nargs="+", metavar="MILESTONES",
                       help="epochs of the multistep schedule")
    group.add_argument("--warmup-epochs", type=int, default=0, metavar="N", help="warm-up epochs (default: 0)")
    group.add_argument("--warmup-lr", type=float, default=1e-5, metavar="LR", help="warm-up start learning rate")
    group.add_argument("--min-lr", type=float, default=0, metavar="LR", help="floor of cyclic schedules")

    group = parser.add_argument_group("Augmentation and regularisation (off by default, as in the paper)")
    group.add_argument("--no-aug", action="store_true", default=True, help="no training augmentation (default)")
    group.add_argument("--aug", dest="no_aug", action="store_false", help="timm's training augmentation")
    group.add_argument("--scale", type=float, nargs="+", default=[0.08, 1.0], metavar="PCT",
                       help="random-resized-crop scale")
    group.add_argument("--ratio", type=float, nargs="+", default=[3. / 4., 4. / 3.], metavar="RATIO",
                       help="random-resized-crop aspect ratio")
    group.add_argument("--hflip", type=float, default=0.5, help="horizontal flip probability (with --aug)")
    group.add_argument("--vflip", type=float, default=0., help="vertical flip probability (with --aug)")
    group.add_argument("--color-jitter", type=float, default=0.4, metavar="PCT", help="colour jitter (with --aug)")
    group.add_argument("--aa", type=str, default=None, metavar="NAME", help="AutoAugment policy (with --aug)")
    group.add_argument("--smoothing", type=float, default=0.0, help="label smoothing (default: 0)")
    group.add_argument("--drop", type=float, default=0.0, metavar="PCT", help="dropout rate (default: 0)")
    group.add_argument("--drop-path", type=float, default=None, metavar="PCT", help="drop path rate")
    group.add_argument("--drop-block", type=float, default=None, metavar="PCT", help="drop block rate")
    group.add_argument("--bn-momentum", type=float, default=None, help="BatchNorm momentum override")
    group.add_argument("--bn-eps", type=float, default=None, help="BatchNorm epsilon override")
    group.add_argument("--dist-bn", type=str, default="reduce",
                       help='BatchNorm statistics across processes before validating: "broadcast", "reduce" or ""')

    group = parser.add_argument_group("Run")
    group.add_argument("--seed", type=int, default=42, metavar="S", help="seed of initialisation, data order and slices")
    group.add_argument("--log-interval", type=int, default=50, metavar="N", help="batches between progress lines")
    group.add_argument("--recovery-interval", type=int, default=100, metavar="N",
                       help="batches between mid-epoch recovery checkpoints (0: epoch ends only)")
    group.add_argument("--checkpoint-hist", type=int, default=1, metavar="N", help="ranked checkpoints kept (default: 1)")
    group.add_argument("--keep-epochs", type=int, nargs="+", default=[], metavar="N",
                       help="also keep the checkpoint after N epochs as epoch-N.pth.tar (a learning curve's points)")
    group.add_argument("-j", "--workers", type=int, default=2, metavar="N", help="data loading processes per process")
    group.add_argument("--pin-mem", action="store_true", default=False, help="pin loader memory")
    group.add_argument("--no-prefetcher", action="store_true", default=False, help="do not use timm's prefetcher")
    group.add_argument("--output", default="", type=str, metavar="PATH", help="output root (default: ./output/train)")
    group.add_argument("--experiment", default="", type=str, metavar="NAME", help="run folder name under --output")
    group.add_argument("--eval-metric", default="top1", type=str, metavar="EVAL_METRIC", help="best-checkpoint metric")
    group.add_argument("--amp", action="store_true", default=False, help="automatic mixed precision")
    group.add_argument("--amp-dtype", default="float16", type=str, help="AMP dtype: float16 or bfloat16")
    group.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", type=str, help="device")
    group.add_argument("--local_rank", default=0, type=int, help=argparse.SUPPRESS)
    return parser


_RECOVERY_PREFIX = "recovery"
# The tensor of a distributed run's last all-reduce, held until the process ends (the end of main says why).
_END_OF_RUN: List[torch.Tensor] = []


def parse_args(argv=None):
    """Command line over the YAML preset's defaults; returns ``(args, args_text)``."""
    args_config, remaining = config_parser.parse_known_args(argv)
    parser = build_parser()
    if args_config.config:
        if not os.path.isfile(args_config.config):
            parser.error(f"config {args_config.config} does not exist")
        with open(args_config.config) as f:
            cfg = yaml.safe_load(f) or {}
        known = {action.dest for action in parser._actions}
        unknown = sorted(set(cfg) - known)
        if unknown:
            parser.error(f"config {args_config.config} sets unknown options {unknown}; keys are long option names "
                         "with '_' (e.g. batch_size, decay_epochs)")
        parser.set_defaults(**cfg)
    args = parser.parse_args(remaining)
    args.config = args_config.config
    return args, yaml.safe_dump(vars(args), default_flow_style=False)


class ResumableClassificationTask(ClassificationTask):
    """timm's ``ClassificationTask`` that also checkpoints where training stands.

    ``progress`` (the epoch and batch to run next, the epoch's running loss and its seconds so far) travels in the
    checkpoint's ``task_state``, so a recovery checkpoint written mid-epoch resumes at the next batch.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.progress = dict(epoch=0, batch=0, loss_sum=0.0, loss_count=0, seconds=0.0)

    def get_task_state(self, module=None, ema=False):
        return {} if ema else {"progress": dict(self.progress)}

    def load_task_state(self, state, strict=True, module=None, ema=False):
        if not ema and state and "progress" in state:
            self.progress = dict(state["progress"])


def find_resume_checkpoint(path: str) -> str:
    """``path`` if it is a file; for a run folder, its checkpoint that is furthest into training."""
    if os.path.isfile(path):
        return path
    if not os.path.isdir(path):
        raise CommandError(f"--resume {path}: no such checkpoint file or run folder")
    candidates = [os.path.join(path, "last.pth.tar")] + glob.glob(os.path.join(path, f"{_RECOVERY_PREFIX}-*.pth.tar"))
    best, best_position = "", None
    for candidate in candidates:
        if not os.path.isfile(candidate):
            continue
        progress = load_checkpoint_metadata(candidate).get("task_state", {}).get("progress")
        if progress is None:
            continue
        position = (progress["epoch"], progress["batch"])
        if best_position is None or position > best_position:
            best, best_position = candidate, position
    if not best:
        raise CommandError(f"--resume {path}: the folder holds no last.pth.tar or {_RECOVERY_PREFIX}-*.pth.tar "
                           "written by this tool")
    return best


def step_seed(seed: int, rank: int, epoch: int, batch: int) -> int:
    """The random seed of one training step: independent of everything that ran before it."""
    return hash((seed, rank, epoch, batch)) & 0x7FFF_FFFF_FFFF


def format_eta(seconds: float) -> str:
    return str(timedelta(seconds=int(max(seconds, 0))))


def build_datasets(args, data_config):
    """The training and (optional) validation data sets, capped by ``--train-samples`` / ``--val-samples``."""
    options = dict(download=args.dataset_download)
    if not is_sortconv_dataset(args.dataset):
        options.update(class_map=args.class_map or None, seed=args.seed, batch_size=args.batch_size,
                       input_img_mode="RGB" if data_config["input_size"][0] == 3 else "L")
    dataset_train = create_dataset(args.dataset, root=args.data_dir, split=args.train_split, **options)
    dataset_train = cap_samples(dataset_train, args.train_samples, seed=args.seed)
    check_input_channels(dataset_train, args.dataset, f"--model {args.model}", data_config, args.input_size is not None)
    dataset_eval = None
    if args.val_split:
        dataset_eval = create_dataset(args.dataset, root=args.data_dir, split=args.val_split, **options)
        dataset_eval = cap_samples(dataset_eval, args.val_samples, seed=args.seed)
    return dataset_train, dataset_eval


def train_one_epoch(epoch, task, loader, optimizer, lr_scheduler, loss_scaler, amp_autocast, saver, args, device,
                    num_epochs):
    """One epoch (or its remainder after a resume); returns the epoch's mean training loss and the seconds its
    training has run (with those before a resume).

    The loss is the mean over the images of all processes. Progress lines and the result sum each process's running
    loss over the processes (a collective at batches every process reaches), so a line printed under torchrun shows
    the mean that ``summary.csv`` records, not process 0's share. ``progress`` (the checkpoint's) holds the sum over
    all processes' images so far and, under torchrun, each process's own sum (``process_sums``, by rank): after a
    resume with as many processes each one goes on from its own, adding its images in the order of an uninterrupted
    epoch, so the resumed loss is bit-identical; with another number of processes, process 0 goes on from the total.
    """
    progress = task.progress
    start_batch = progress["batch"]
    num_batches = start_batch + len(loader)
    model = task.get_trainable_module()
    task.train()
    batch_time_m, data_time_m = utils.AverageMeter(), utils.AverageMeter()
    process_sums = progress.get("process_sums")
    if process_sums is not None and len(process_sums) == args.world_size:
        loss_sum, loss_count = process_sums[args.rank]
    else:
        loss_sum, loss_count = (progress["loss_sum"], progress["loss_count"]) if args.rank == 0 else (0.0, 0)

    def all_processes(*values):
        """``values`` summed over the processes (as they are, in one process)."""
        if not args.distributed:
            return values
        summed = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(summed)
        return tuple(summed.tolist())

    def by_process(*values):
        """``values`` of every process, by rank."""
        mine = torch.tensor(values, dtype=torch.float64, device=device)
        rows = [torch.empty_like(mine) for _ in range(args.world_size)]
        dist.all_gather(rows, mine)
        return [row.tolist() for row in rows]

    # checkpoints written before the epoch's seconds were kept have none: that part of the epoch counts 0
    seconds, start = progress.get("seconds", 0.0), time.time()
    end = time.time()
    for batch_idx, (input, target) in enumerate(loader, start=start_batch):
        lrs = [param_group["lr"] for param_group in optimizer.param_groups]  # the rate of this update, as timm logs it
        lr = sum(lrs) / len(lrs)
        data_time_m.update(time.time() - end)
        if args.no_prefetcher:
            input, target = input.to(device), target.to(device)
        if args.channels_last:
            input = input.contiguous(memory_format=torch.channels_last)
        torch.manual_seed(step_seed(args.seed, args.rank, epoch, batch_idx))
        with amp_autocast():
            loss = task(input, target)["loss"]
        optimizer.zero_grad(set_to_none=True)
        if loss_scaler is not None:
            loss_scaler(loss, optimizer, clip_grad=args.clip_grad, clip_mode=args.clip_mode,
                        parameters=model.parameters())
        else:
            loss.backward()
            if args.clip_grad is not None:
                utils.dispatch_clip_grad(model.parameters(), value=args.clip_grad, mode=args.clip_mode)
            optimizer.step()
        if lr_scheduler is not None:
            lr_scheduler.step_update(num_updates=epoch * num_batches + batch_idx + 1)
        loss_sum += loss.item() * input.shape[0]
        loss_count += input.shape[0]
        batch_time_m.update(time.time() - end)
        end = time.time()

        done = batch_idx + 1
        if done % args.log_interval == 0 or done == num_batches:
            batch_sum, batch_count, epoch_sum, epoch_count = all_processes(
                loss.item() * input.shape[0], input.shape[0], loss_sum, loss_count)
            if utils.is_primary(args):
                rate = input.shape[0] * args.world_size / batch_time_m.val
                rate_avg = input.shape[0] * args.world_size / batch_time_m.avg
                left_epoch = (num_batches - done) * batch_time_m.avg
                left_run = left_epoch + (num_epochs - epoch - 1) * num_batches * batch_time_m.avg
                _logger.info(
                    f"Train: {epoch} [{done:>4d}/{num_batches} ({100. * done / num_batches:>3.0f}%)]  "
                    f"Loss: {batch_sum / batch_count:#.3g} ({epoch_sum / epoch_count:#.3g})  "
                    f"Time: {batch_time_m.val:.3f}s, {rate:>7.2f}/s  ({batch_time_m.avg:.3f}s, {rate_avg:>7.2f}/s)  "
                    f"LR: {lr:.3e}  Data: {data_time_m.val:.3f} ({data_time_m.avg:.3f})  "
                    f"ETA: epoch {format_eta(left_epoch)}, run {format_eta(left_run)}")
        if args.recovery_interval and done % args.recovery_interval == 0 and done < num_batches:
            task.progress = dict(epoch=epoch, batch=done, loss_sum=loss_sum, loss_count=loss_count,
                                 seconds=seconds + time.time() - start)
            if args.distributed:
                sums = by_process(loss_sum, loss_count)
                task.progress.update(loss_sum=sum(row[0] for row in sums), loss_count=sum(row[1] for row in sums),
                                     process_sums=sums)
            if saver is not None:
                saver.save_recovery(epoch, batch_idx=done)
    epoch_sum, epoch_count = all_processes(loss_sum, loss_count)
    return OrderedDict(loss=epoch_sum / max(epoch_count, 1), seconds=seconds + time.time() - start)


@torch.inference_mode()
def validate(task, loader, args, amp_autocast, log_suffix=""):
    """Loss, top-1 and top-5 accuracy (%) over the whole validation set, each image counted once.

    Under torchrun each process evaluates its shard of the set; timm's ordered distributed sampler pads the last
    shards with repeated images so that every process runs as many batches, and the evaluator drops those. Every
    progress line sums the counts of all processes so far (a collective, which every process joins at the same
    batches), so the last line printed is the number returned, which ``summary.csv`` records and the checkpoints
    are ranked by, and which one process computes on the same images (``scripts/validate.py``).
    """
    eval_model = task.get_eval_model()
    eval_model.eval()
    evaluator = task.create_evaluator(max_samples=evaluation_sample_limit(loader))
    num_batches = len(loader)
    start = time.time()

    def measure(done):
        metrics = evaluator.compute(distributed=args.distributed)
        if utils.is_primary(args):
            _logger.info(f"Test{log_suffix}: [{done:>4d}/{num_batches}]  Loss: {metrics['loss']:.4f}  "
                         f"Acc@1: {metrics['top1']:.3f}  Acc@5: {metrics['top5']:.3f}  "
                         f"({time.time() - start:.1f}s)")
        return metrics

    for batch_idx, (input, target) in enumerate(loader):
        if args.no_prefetcher:
            input, target = input.to(task.device), target.to(task.device)
        if args.channels_last:
            input = input.contiguous(memory_format=torch.channels_last)
        with amp_autocast():
            output = eval_model(input)
        evaluator.update(output, target)
        if (batch_idx + 1) % args.log_interval == 0 and batch_idx + 1 < num_batches:
            measure(batch_idx + 1)
    return measure(num_batches)


def keep_epoch_checkpoint(output_dir: str, epochs_done: int, keep_epochs, source: str) -> None:
    """Copies ``source`` (the checkpoint after ``epochs_done`` epochs) to ``<output_dir>/epoch-<epochs_done>.pth.tar``
    if ``epochs_done`` is one of ``keep_epochs`` and the copy is not there yet (a run killed between the two
    writes makes it on resuming)."""
    if epochs_done not in keep_epochs:
        return
    path = os.path.join(output_dir, f"epoch-{epochs_done}.pth.tar")
    if not os.path.isfile(path):
        shutil.copyfile(source, path + ".tmp")
        os.replace(path + ".tmp", path)


def remove_recovery_files(saver) -> None:
    """Drops the recovery checkpoints (this run's and a resumed run's) once an epoch's checkpoint is on disk."""
    for path in glob.glob(os.path.join(saver.recovery_dir, f"{_RECOVERY_PREFIX}-*.pth.tar")):
        os.remove(path)
    saver.curr_recovery_file = saver.prev_recovery_file = ""


def main(argv=None):
    args, args_text = parse_args(argv)
    check_image_folder(args.dataset, args.data_dir)
    if any(n < 1 for n in args.keep_epochs):
        raise CommandError(f"--keep-epochs {' '.join(map(str, args.keep_epochs))}: epochs are counted from 1")
    if torch.cuda.is_available():
        torch.backends.cudnn.benchmark = False  # the same kernels every run, for resumable runs

    args.prefetcher = not args.no_prefetcher
    device = utils.init_distributed_device(args)
    if args.distributed:
        _logger.info(f"Distributed training: process {args.rank} of {args.world_size}, device {args.device}.")
    else:
        _logger.info(f"Training with a single process on {args.device}.")

    use_amp = args.amp
    amp_dtype = torch.bfloat16 if args.amp_dtype == "bfloat16" else torch.float16
    amp_autocast = partial(torch.autocast, device_type=device.type, dtype=amp_dtype) if use_amp else nullcontext
    loss_scaler = utils.NativeScaler(device=device.type) if use_amp and device.type == "cuda" and \
        amp_dtype == torch.float16 else None

    utils.random_seed(args.seed, 0)  # every process builds the same initial model
    in_chans = args.in_chans if args.in_chans is not None else (args.input_size[0] if args.input_size else None)
    model = create_model(
        args.model,
        pretrained=args.pretrained,
        num_classes=args.num_classes,
        drop_rate=args.drop,
        drop_path_rate=args.drop_path,
        drop_block_rate=args.drop_block,
        global_pool=args.gp,
        bn_momentum=args.bn_momentum,
        bn_eps=args.bn_eps,
        checkpoint_path=args.initial_checkpoint,
        **({"in_chans": in_chans} if in_chans is not None else {}),
        **args.model_kwargs,
    )
    if args.num_classes is None:
        args.num_classes = model.num_classes
    if args.grad_checkpointing:
        model.set_grad_checkpointing(enable=True)
    data_config = resolve_data_config(vars(args) | {"in_chans": in_chans}, model=model, dataset=args.dataset,
                                      verbose=utils.is_primary(args))
    if utils.is_primary(args):
        _logger.info(f"Model {safe_model_name(args.model)} created, "
                     f"param count: {sum(p.numel() for p in model.parameters())}")

    model.to(device=device)
    if args.channels_last:
        model.to(memory_format=torch.channels_last)
    task = ResumableClassificationTask(model, criterion_kwargs=dict(smoothing=args.smoothing), device=device,
                                       verbose=utils.is_primary(args))
    optimizer = create_optimizer_v2(model, **optimizer_kwargs(cfg=args), **args.opt_kwargs)

    resume_path = find_resume_checkpoint(args.resume) if args.resume else ""
    if resume_path:
        resume_task_checkpoint(task, resume_path, optimizer=None if args.no_resume_opt else optimizer,
                               loss_scaler=None if args.no_resume_opt else loss_scaler,
                               log_info=utils.is_primary(args))
    start_epoch = task.progress["epoch"]

    if args.torchcompile:
        task.compile(backend=args.torchcompile, mode=args.torchcompile_mode)
    if args.distributed:
        task.prepare_distributed(device_ids=[device] if device.type == "cuda" else None)

    dataset_train, dataset_eval = build_datasets(args, data_config)
    train_interpolation = data_config["interpolation"]
    loader_train = create_train_loader(
        dataset_train,
        input_size=data_config["input_size"],
        batch_size=args.batch_size,
        seed=args.seed,
        num_replicas=args.world_size,
        rank=args.rank,
        num_workers=args.workers,
        use_prefetcher=args.prefetcher,
        device=device,
        pin_memory=args.pin_mem,
        mean=data_config["mean"],
        std=data_config["std"],
        no_aug=args.no_aug,
        scale=args.scale,
        ratio=args.ratio,
        hflip=args.hflip,
        vflip=args.vflip,
        color_jitter=args.color_jitter,
        auto_augment=args.aa,
        interpolation=train_interpolation,
    )
    loader_eval = None
    if dataset_eval is not None:
        loader_eval = create_loader(
            dataset_eval,
            input_size=data_config["input_size"],
            batch_size=args.validation_batch_size or args.batch_size,
            is_training=False,
            interpolation=data_config["interpolation"],
            mean=data_config["mean"],
            std=data_config["std"],
            num_workers=args.workers,
            distributed=args.distributed,
            crop_pct=data_config["crop_pct"],
            pin_memory=args.pin_mem,
            device=device,
            use_prefetcher=args.prefetcher,
        )

    updates_per_epoch = len(loader_train)
    lr_scheduler, num_epochs = create_scheduler_v2(optimizer, **scheduler_kwargs(args),
                                                   updates_per_epoch=updates_per_epoch)
    if lr_scheduler is not None and start_epoch > 0:
        lr_scheduler.step(start_epoch)

    saver, output_dir = None, None
    if utils.is_primary(args):
        if args.experiment:
            output_dir = utils.get_outdir(args.output or "./output/train", args.experiment)
        elif args.resume and os.path.isdir(args.resume):
            output_dir = args.resume
        else:
            name = "-".join([datetime.now().strftime("%Y%m%d-%H%M%S"), safe_model_name(args.model),
                             str(data_config["input_size"][-1])])
            output_dir = utils.get_outdir(args.output or "./output/train", name)
        saver = utils.CheckpointSaver(model=model, optimizer=optimizer, args=args, amp_scaler=loss_scaler,
                                      checkpoint_dir=output_dir, recovery_dir=output_dir,
                                      recovery_prefix=_RECOVERY_PREFIX, decreasing="loss" in args.eval_metric,
                                      max_history=args.checkpoint_hist, task=task)
        if resume_path:
            saver.load_state_dict_from_checkpoint(resume_path)
            if task.progress["batch"] == 0:
                keep_epoch_checkpoint(output_dir, start_epoch, args.keep_epochs, resume_path)
        with open(os.path.join(output_dir, "args.yaml"), "w") as f:
            f.write(args_text)
        summary_path = os.path.join(output_dir, "summary.csv")
        utils.trim_summary(summary_path, start_epoch)
        _logger.info(f"Output: {output_dir}; training epochs {start_epoch}..{num_epochs - 1}"
                     + (f", resuming at batch {task.progress['batch']} of epoch {start_epoch}" if task.progress['batch']
                        else ""))

    best_metric, best_epoch = (saver.best_metric, saver.best_epoch) if saver is not None else (None, None)
    for epoch in range(start_epoch, num_epochs):
        start_batch = task.progress["batch"]
        loader_train.sampler.set_epoch(epoch, start_batch * args.batch_size)
        if lr_scheduler is not None:  # per-update schedules only; per-epoch ones were stepped at the epoch's end
            lr_scheduler.step_update(num_updates=epoch * updates_per_epoch + start_batch)
        train_metrics = train_one_epoch(epoch, task, loader_train, optimizer, lr_scheduler, loss_scaler, amp_autocast,
                                        saver, args, device, num_epochs)
        eval_metrics = None
        if loader_eval is not None:
            if args.distributed and args.dist_bn in ("broadcast", "reduce"):
                utils.distribute_bn(model, args.world_size, args.dist_bn == "reduce")
            eval_start = time.time()
            eval_metrics = validate(task, loader_eval, args, amp_autocast)
            train_metrics["seconds"] += time.time() - eval_start
        # summary.csv's rate, as timm's train.py records it: the optimizer's (mean over its groups) after the epoch's
        # updates, before the per-epoch step
        lrs = [param_group["lr"] for param_group in optimizer.param_groups]
        if lr_scheduler is not None:
            lr_scheduler.step(epoch + 1, eval_metrics[args.eval_metric] if eval_metrics else None)
        task.progress = dict(epoch=epoch + 1, batch=0, loss_sum=0.0, loss_count=0, seconds=0.0)
        if saver is not None:
            # Summary row first, then the checkpoint: a run killed in between redoes the epoch and rewrites the row.
            utils.update_summary(epoch, train_metrics, eval_metrics, filename=summary_path, lr=sum(lrs) / len(lrs))
            metric = eval_metrics[args.eval_metric] if eval_metrics else None
            best_metric, best_epoch = saver.save_checkpoint(epoch, metric=metric)
            keep_epoch_checkpoint(output_dir, epoch + 1, args.keep_epochs, os.path.join(output_dir, "last.pth.tar"))
            remove_recovery_files(saver)
    if best_metric is not None:
        _logger.info(f"*** Best metric: {best_metric} (epoch {best_epoch})")
    if args.distributed:
        # Every process reaches the end before the group is torn down (with gloo on torch 2.9, a process that left
        # while process 0 was still saving could hang at exit). Not with dist.barrier(): gloo's barrier holds the
        # earlier collectives' work, whose tensors (validate's sums) its worker thread then frees, which takes the
        # GIL, while this thread, holding the GIL, joins that worker as DDP's reducer drops the group: a deadlock
        # (py-spy on torch 2.9.1). One all-reduce holds only its own tensor, kept alive here past the teardown.
        _END_OF_RUN.append(torch.zeros(1))
        dist.all_reduce(_END_OF_RUN[-1])
        dist.destroy_process_group()
    return output_dir


if __name__ == "__main__":
    run(main)
