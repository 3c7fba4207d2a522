"""The ``dynarec`` command: make-data, plan, verify, train, evaluate, export, predict, tdm, demo, bench."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import math
import os
import re
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Optional

from dynarec.files import json_text

__all__ = ["main"]


def _config_for(args):
    from dynarec.config import load_config
    from dynarec.train.model_dir import EXPORT_KIND, other_kind

    model_dir = getattr(args, "model_dir", None)
    path = args.config or (Path(model_dir) / "config.yaml" if model_dir else None)
    if path is None:
        raise ValueError("give --config (or --model-dir holding config.yaml)")
    other = other_kind(Path(model_dir)) if model_dir and not args.config else None
    if other is not None and other[0] == EXPORT_KIND:
        raise ValueError(
            f"--model-dir {model_dir} is {EXPORT_KIND}, not a model directory: score it with "
            f"`dynarec predict --export-dir {model_dir} --input ...`"
        )
    return load_config(path)


def _given(args, *names: str) -> dict[str, Any]:
    """The options ``names`` (``args``' attribute names, defaulting to None) given on the command
    line, with their values: a default stays the dataclass's they are passed to."""
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


def _flags(options: dict[str, Any]) -> str:
    """``{"poll_seconds": ..., ...}`` as the command line spells them: ``--poll-seconds and ...``."""
    return " and ".join(f"--{n.replace('_', '-')}" for n in options)


def cmd_make_data(args) -> None:
    # (the other generator's options would be ignored)
    demo_only, config_only = _given(args, "num_users", "num_items"), _given(args, "max_sequence_length")
    if args.config and demo_only:
        verb = "shapes" if len(demo_only) == 1 else "shape"
        raise ValueError(f"{_flags(demo_only)} {verb} the demo's click log, not --config's data")
    if not args.config and config_only:
        raise ValueError("--max-sequence-length goes with --config (the demo's click log has its own histories)")
    output = Path(args.output_dir).resolve()  # ('.': the directory's own name, checked like any other)
    if args.config:
        from dynarec.config import load_config
        from dynarec.data.generate import EDGES_PER_USER, GenerateSpec, make_config_data

        meta = make_config_data(
            load_config(args.config),
            output,
            GenerateSpec(train_rows=args.train_rows, eval_rows=args.eval_rows, seed=args.seed, **config_only),
        )
        labels = (
            f"; click rate {meta['eval_click_rate']:.3f}; Bayes-optimal eval AUC {meta['bayes_optimal_eval_auc']:.4f}"
            if "eval_click_rate" in meta
            else " (the model reads no label)"
        )
        print(
            f"wrote {meta['train_rows']} train and {meta['eval_rows']} eval rows of the columns of {args.config} "
            f"({', '.join(meta['columns'])}) under {args.output_dir}{labels}"
        )
        for path in meta["vocab_files_written"]:
            print(f"wrote the vocab_file {path} (it did not exist: a vocabulary, or a tokenizer of the made-up words)")
        if meta.get("edge_table_written"):
            print(f"wrote the hard negatives' edge table {meta['edge_table_written']} ({EDGES_PER_USER} items a user)")
        if meta.get("tree_written"):
            t = meta["tree_written"]
            print(
                f"wrote the TDM tree {t['path']} and its edge table ({t['items']} items, {t['levels']} levels: "
                f"data.tdm_sampler.layer_num_sample takes {t['levels']} entries)"
            )
        if meta["item_table_written"]:
            print(
                f"wrote the negative sampler's item table {meta['item_table_written']} "
                "(it did not exist, or lies in the data directory)"
            )
        return
    from dynarec.data.synthetic import SyntheticSpec, make_click_log

    spec = SyntheticSpec(train_rows=args.train_rows, eval_rows=args.eval_rows, seed=args.seed, **demo_only)
    meta = make_click_log(output, spec)
    print(
        f"wrote {meta['train_rows']} train and {meta['eval_rows']} eval rows under {args.output_dir}; "
        f"click rate {meta['eval_click_rate']:.3f}; Bayes-optimal eval AUC {meta['bayes_optimal_eval_auc']:.4f}"
    )


def cmd_plan(args) -> None:
    from dynarec.planner import plan_from_config

    print(plan_from_config(_config_for(args), world_size=args.world_size).format())


def cmd_train(args) -> None:
    """One process, or one rank of a torchrun job (``--nproc N`` starts that job: torchrun
    --standalone --nproc-per-node N -m dynarec train ...)."""
    given = _given(args, "poll_seconds", "idle_timeout")
    if given and not args.follow:  # (they would be ignored)
        raise ValueError(f"{_flags(given)} go{'es' if len(given) == 1 else ''} with --follow")
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        _config_for(args)  # a config error is reported here, once, not by every rank
        _launch_torchrun(args.nproc, args.argv, lambda: _latest_note(args))
        return
    from dynarec.distributed.context import init_distributed
    from dynarec.train.trainer import FollowOptions, Trainer

    config = _config_for(args)
    follow = (
        FollowOptions(idle_timeout_seconds=args.idle_timeout, **_given(args, "poll_seconds")) if args.follow else None
    )
    ctx = init_distributed(args.device, config.train.collective_timeout_seconds)
    try:
        trainer = Trainer(
            config, args.model_dir, device=args.device, progress=not args.no_progress, ctx=ctx, follow=follow
        )
        if ctx.is_main:
            print(trainer.task.plan.format())
        report = trainer.fit(resume=args.resume)
        if ctx.is_main:
            print(json_text(report))
    finally:
        if ctx.distributed:
            import torch.distributed as dist

            dist.destroy_process_group()


def _launch_torchrun(nproc: int, argv: list[str], latest_note: Callable[[], str]) -> None:
    """Runs this very command (``argv``) as a torchrun job of ``nproc`` processes on this host;
    ``latest_note()`` names the model directory's latest checkpoint once it has stopped."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    from dynarec.train.stop import TrainingStopped
    from dynarec.train.trainer import TrainingError

    i = next(k for k, a in enumerate(argv) if a == "--nproc" or a.startswith("--nproc="))
    argv = argv[:i] + argv[i + (1 if "=" in argv[i] else 2) :]
    try:
        torchrun(["--standalone", f"--nproc-per-node={nproc}", "-m", "dynarec", *argv])
    except SignalException as e:  # torchrun passed it on to the ranks: they stop after a step, saved
        raise TrainingStopped(
            f"the {nproc}-process job stopped by {e.sigval.name}{latest_note()}", int(e.sigval)
        ) from None
    except ChildFailedError as e:
        codes = sorted({f.exitcode for f in e.failures.values()})
        if codes == [128 + signal.SIGTERM]:  # the ranks were sent SIGTERM, not torchrun: they stopped, saved
            raise TrainingStopped(
                f"the {nproc}-process job stopped by SIGTERM{latest_note()}", signal.SIGTERM
            ) from None
        raise TrainingError(
            f"the {nproc}-process job failed (exit codes {codes}); the ranks' messages are above"
        ) from None


def _restored(args):
    from dynarec.train.trainer import Trainer

    trainer = Trainer(_config_for(args), args.model_dir, device=args.device, progress=False)
    path = trainer.restore(training=False)
    print(f"restored {path}", file=sys.stderr)
    return trainer


def cmd_evaluate(args) -> None:
    trainer = _restored(args)
    print(json_text(trainer.evaluate(args.input or None)))


def cmd_export(args) -> None:
    import json

    from dynarec.export_format import META

    trainer = _restored(args)
    try:  # an export there before: deltas written on it apply to it alone
        replaced = json.loads((Path(args.export_dir) / META).read_text())
    except (OSError, ValueError):
        replaced = None
    export_dir = trainer.export(args.export_dir, since=args.since)
    kind = f"a delta on {args.since}" if args.since else "a full export"
    print(f"exported step {trainer.step} to {export_dir} ({kind})")
    if isinstance(replaced, dict) and "step" in replaced:
        print(
            f"note: it replaced the export of step {replaced['step']} that {export_dir} held; a delta written on "
            "that one does not apply to this one (export the deltas again, --since this export)",
            file=sys.stderr,
        )


def cmd_predict(args) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dynarec.data.batch import BatchBuilder
    from dynarec.data.reader import file_schema, resolve_files
    from dynarec.files import atomic_path

    files = resolve_files(args.input, "--input")
    if Path(args.output).is_dir():
        raise FileExistsError(f"--output {args.output} is a directory; predict writes one Parquet file")
    _check_prediction_target(Path(args.output), files, args)
    if Path(args.output).suffix.lower() in (".csv", ".json", ".jsonl", ".txt", ".tsv"):
        raise ValueError(f"--output {args.output}: predict writes one Parquet file; name it .parquet")
    reserved = [c.strip() for c in (args.reserved_columns or "").split(",") if c.strip()]
    if args.export_dir:
        from dynarec.serving import ExportedModel

        model = ExportedModel(args.export_dir, device=args.device)
        config = model.config
    else:
        trainer = _restored(args)
        config = trainer.config
    # The columns passed through are read as scoring reads them (a CSV id column as strings:
    # "00270" stays "00270"), and before any scoring.
    read = (config.data.input_type, BatchBuilder(config, with_labels=False).csv_column_types())
    schemas = [file_schema(f, *read) for f in files]
    for f, schema in zip(files, schemas):
        missing = [c for c in reserved if c not in schema.names]
        if missing:
            raise ValueError(f"--reserved-columns: {f} has no column(s) {missing}")
    labels = [c for c in config.label_fields() if c not in reserved and all(c in s.names for s in schemas)]
    passed = _input_columns(files, [*reserved, *labels], *read)
    if args.export_dir:
        outputs = model.predict_files(files)
    else:
        outputs, _, _ = trainer.predict(files, with_labels=False, per_row=True)  # (a list a row, of candidates)
    columns = {name: _prediction_column(x) for name, x in outputs.items()}
    clash = [c for c in reserved if c in columns]
    if clash:
        raise ValueError(f"--reserved-columns {clash}: the predictions have column(s) of that name")
    rows = len(next(iter(columns.values())))
    for name, values in passed.items():  # the input's rows in the predictions' order (files sorted, rows in order)
        if name in columns:  # (a label the model also outputs under that name)
            continue
        if len(values) != rows:
            raise ValueError(f"--reserved-columns: {name} has {len(values)} rows, the predictions {rows}")
        columns[name] = values
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(Path(args.output)) as tmp:
        pq.write_table(pa.table(columns), str(tmp))
    n = len(next(iter(outputs.values())))
    print(f"wrote {n} prediction{'' if n == 1 else 's'} to {args.output}")


def _input_columns(files: list, names: list[str], input_type, csv_types) -> dict:
    """Columns ``names`` of ``files``, the files' rows in order, each one Arrow array of one type,
    as the files store it (nulls kept): a column stored as ``string`` in one file and
    ``large_string`` in another, or ``int64`` and ``uint32``, comes out in the type holding both;
    ValueError naming the column and two files whose types do not combine."""
    import pyarrow as pa

    from dynarec.data.reader import read_table

    if not names:
        return {}
    tables = [read_table(f, names, input_type, csv_types) for f in files]
    try:
        whole = pa.concat_tables(tables, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        for name in names:
            first = tables[0].schema.field(name).type
            for f, t in zip(files[1:], tables[1:]):
                if t.schema.field(name).type != first:
                    raise ValueError(
                        f"--input: column '{name}' is {first} in {files[0]} and {t.schema.field(name).type} in {f}, "
                        "which do not combine into one output column"
                    ) from None
        raise
    return {name: whole.column(name).combine_chunks() for name in names}


def _check_prediction_target(output: Path, files: list, args) -> None:
    """FileExistsError where predict's ``--output`` would write over what it reads or what dynarec
    keeps: an input file, a file in an input directory (the next run would read it as data), in
    the export (its manifest lists its files), the model directory's checkpoints or any file the
    model directory holds (a new file beside them is fine)."""
    out = output.resolve()
    if any(Path(f).resolve() == out for f in files):
        raise FileExistsError(f"--output {output} is one of the --input files; write the predictions elsewhere")
    places = [("--input", Path(p)) for p in args.input if Path(p).is_dir()]
    if args.export_dir:
        places.append(("--export-dir", Path(args.export_dir)))
    if args.model_dir:
        places.append(("--model-dir", Path(args.model_dir) / "checkpoints"))
    for flag, place in places:
        if out.is_relative_to(place.resolve()):
            raise FileExistsError(f"--output {output} lies in {flag} {place}; write the predictions outside it")
    if args.model_dir and out.is_file() and out.is_relative_to(Path(args.model_dir).resolve()):
        raise FileExistsError(f"--output {output} is a file of --model-dir {args.model_dir}; write it elsewhere")


def _prediction_column(x):
    """A prediction as a Parquet column: float32 (int64: a semantic-ID model's codes), a fixed-size
    list for a row of class probabilities or codes; a list a row of a model scoring each row's
    candidates (an object array)."""
    import numpy as np
    import pyarrow as pa

    if x.dtype == object:  # a list a row: its candidates' predictions (each a number or a row of classes)
        rows = [np.asarray(r, dtype=np.float32) for r in x]
        inner = pa.float32() if not rows or rows[0].ndim == 1 else pa.list_(pa.float32())
        return pa.array([r.tolist() for r in rows], pa.list_(inner))
    x = x.astype(np.int64 if x.dtype.kind in "iu" else np.float32)  # codes stay integers
    if x.ndim == 1:
        return pa.array(x)
    return pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), x.shape[1])


CONVERTED_BY = "# Converted by `dynarec import-config`"  # the first line of what import-config writes


def _body_digest(text: str) -> str:
    """SHA-256 (16 hex digits) of a converted config's YAML: ``text`` after its leading comment
    lines (import-config's header)."""
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if not line.startswith("#")), len(lines))
    return hashlib.sha256("".join(lines[start:]).encode()).hexdigest()[:16]


def _check_import_target(output: Path, overwrite: bool) -> None:
    """FileExistsError where ``output`` is a file import-config did not write (a config of the
    user's own, say), or one it wrote and that was edited since (its header's digest of the YAML
    no longer matches), unless ``overwrite``: a conversion written again over its own untouched
    output replaces it, as a build step does."""
    if overwrite or not output.exists() or output.is_dir():  # (a directory fails the write, named)
        return
    try:
        text = output.read_text()
    except (OSError, UnicodeDecodeError):
        text = ""
    if not text.startswith(CONVERTED_BY):
        raise FileExistsError(
            f"-o {output} exists and was not written by import-config; choose another name, or pass --overwrite "
            "to replace it"
        )
    recorded = re.search(r"\(YAML sha256 ([0-9a-f]{16})\)\.$", text.splitlines()[0])
    if recorded is not None and recorded.group(1) != _body_digest(text):
        raise FileExistsError(
            f"-o {output} was edited since import-config wrote it; choose another name, or pass --overwrite to "
            "replace it"
        )


def cmd_import_config(args) -> None:
    import yaml

    from dynarec.config import config_from_dict
    from dynarec.config.textproto import TextFormatError
    from dynarec.config.tzrec import ConversionError, convert_pipeline_config
    from dynarec.config.tzrec.model import model_name
    from dynarec.files import atomic_write_text

    source = Path(args.pipeline_config)
    if Path(args.output).resolve() == source.resolve():
        raise ValueError(
            f"-o {args.output} is the pipeline config being converted; dynarec never writes over its input"
        )
    try:
        text = source.read_text()
    except UnicodeDecodeError as e:
        raise ConversionError(f"{source} is not UTF-8 text (byte {e.start}: a binary file?)") from None
    output = Path(args.output)
    _check_import_target(output, args.overwrite)
    try:
        result = convert_pipeline_config(
            text,
            train_input_path=args.train_input_path,
            eval_input_path=args.eval_input_path,
            sampler_input_path=args.sampler_input_path,
            hard_negative_edge_path=args.hard_negative_edge_path,
            tree_dir=args.tree_dir,
            lenient=args.lenient,
            config_dir=source.parent,  # a relative vocab_file is relative to the pipeline config ...
            output_dir=output.parent,  # ... and every path written relative to the YAML
        )
    except TextFormatError as e:
        raise ConversionError(f"{source}: {e}") from None
    config_from_dict(result.config, base_dir=output.parent)  # what is written must load
    body = yaml.safe_dump(result.config, sort_keys=False, allow_unicode=True)
    header = [f"{CONVERTED_BY} from {source} (YAML sha256 {_body_digest(body)}).", "# Mapped and ignored fields:"]
    header += [f"#   {n}" for n in result.notes] or ["#   (none)"]
    if result.dropped:
        header += ["# Dropped (--lenient):"] + [f"#   {d}" for d in result.dropped]
    output.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(output, "\n".join(header) + "\n" + body)
    for n in result.notes:
        print(f"note: {n}")
    for d in result.dropped:
        print(f"dropped: {d}")
    model = model_name(result.config["model"])
    print(f"wrote {output} ({len(result.config['feature_configs'])} features, model {model})")


def _fields(text: Optional[str]) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()] if text else []


def cmd_tdm_init_tree(args) -> None:
    import numpy as np
    import pyarrow as pa

    from dynarec.data.reader import file_schema, read_table, resolve_files
    from dynarec.data.tree import init_tree, node_attribute, write_tree

    attrs, raw = _fields(args.attr_fields), _fields(args.raw_attr_fields)
    columns = list(dict.fromkeys([args.item_id_field, args.cate_id_field, *attrs, *raw]))
    files = resolve_files(args.items, "--items")
    # a CSV file's ids and attributes as strings, as training reads them ("001" is not 1)
    strings = {c: pa.string() for c in [args.item_id_field, args.cate_id_field, *attrs]}
    tables, ids_of = [], []
    for f in files:
        names = file_schema(f, None, strings).names
        missing = [c for c in columns if c not in names]
        if missing:
            raise ValueError(f"{f}: missing column(s) {missing} (of --item-id-field, --cate-id-field, the attr fields)")
        table = read_table(f, columns, None, strings)
        ids_of.append(_item_ids(table.column(args.item_id_field), f, args.item_id_field))
        tables.append(table.select(columns))
    items = pa.concat_tables(tables, promote_options="permissive")
    ids = np.concatenate(ids_of)
    unique, counts = np.unique(ids, return_counts=True)
    if (counts > 1).any():
        raise ValueError(
            f"{', '.join(files)}: item {unique[counts > 1][0]} is listed twice; an item table lists each item once"
        )
    tree = init_tree(
        ids,
        node_attribute(items.column(args.cate_id_field)),
        [node_attribute(items.column(c)) for c in [*attrs, *raw]],
        n_cluster=args.n_cluster,
        raw=range(len(attrs), len(attrs) + len(raw)),
    )
    out = write_tree(tree, args.output_dir, args.attr_delimiter)
    _print_tree(tree, out, [*attrs, *raw])


def _item_ids(column, path: str, field: str):
    """The item ids of ``column`` (``field`` of ``path``) as int64; ValueError naming the file and
    row of the first that is not a whole number of 0 or more: the tree's nodes are int64 ids, and
    -1 is graph-learn's handle of the root (skipped where the tree is read)."""
    import numpy as np
    import pyarrow as pa

    column = column.combine_chunks()
    nulls = np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))
    if len(nulls):
        raise ValueError(f"{path}, row {nulls[0]}: column '{field}' (--item-id-field): the item id is empty")
    try:
        ids = column.cast(pa.int64()).to_numpy(zero_copy_only=False)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        bad = next((i for i, v in enumerate(column.to_pylist()) if not _is_int64(v)), None)
        where = f"{path}, row {bad}" if bad is not None else path
        what = f"{column[bad].as_py()!r} is not a whole number" if bad is not None else "the item ids must be integers"
        raise ValueError(f"{where}: column '{field}' (--item-id-field): {what}") from None
    negative = np.flatnonzero(ids < 0)
    if len(negative):
        row = negative[0]
        raise ValueError(
            f"{path}, row {row}: column '{field}' (--item-id-field): item id {ids[row]} is negative; item ids are 0 or "
            "more (-1 is graph-learn's handle of the tree's root)"
        )
    return ids


def _is_int64(value) -> bool:
    try:
        return -(2**63) <= int(str(value)) < 2**63
    except ValueError:
        return False


def _print_tree(tree, out: Path, attr_fields: list[str]) -> None:
    import numpy as np

    print(
        f"wrote the tree of {int(np.diff(tree.level_starts)[-1])} items under {out} (node_table.txt, edge_table.txt, "
        f"predict_edge_table.txt): {tree.num_levels} levels, node ids up to {int(tree.ids.max())}; "
        f"data.tdm_sampler: item_input_path {out / 'node_table.txt'}, edge_input_path {out / 'edge_table.txt'}, "
        f"attr_fields {attr_fields}, layer_num_sample of {tree.num_levels} entries"
    )


def cmd_tdm_cluster_tree(args) -> None:
    from dynarec.data.batch import BatchBuilder
    from dynarec.data.reader import file_schema, resolve_files
    from dynarec.data.tree import EDGE_TABLE, NODE_TABLE, PREDICT_EDGE_TABLE, cluster_tree, write_tree
    from dynarec.tdm import config_tree, item_embeddings

    trainer = _restored(args)
    config = trainer.config
    tree = config_tree(config)
    cfg = config.data.tdm_sampler
    assert cfg is not None
    written = {(Path(args.output_dir) / n).resolve() for n in (NODE_TABLE, EDGE_TABLE, PREDICT_EDGE_TABLE)}
    if written & {Path(cfg.item_input_path).resolve(), Path(cfg.edge_input_path).resolve()}:
        raise ValueError(
            f"--output-dir {args.output_dir} holds the tree {args.model_dir} was trained on (data.tdm_sampler); the "
            "learnt tree would replace it under the model (whose node ids are that tree's): write it to another "
            "directory"
        )
    raw = _fields(args.raw_attr_fields)
    unknown = [c for c in raw if c not in cfg.attr_fields]
    if unknown:
        raise ValueError(f"--raw-attr-fields: {unknown} are not among data.tdm_sampler.attr_fields {cfg.attr_fields}")
    # the data's column types (a CSV file's ids as strings, as training reads them)
    csv_types = BatchBuilder(config, with_labels=False).csv_column_types()
    first = resolve_files(config.data.train_input_path)[0]
    types = {f.name: f.type for f in file_schema(first, config.data.input_type, csv_types)}
    embeddings = item_embeddings(trainer.task, config, tree, types)
    leaves = slice(int(tree.level_starts[-2]), len(tree.ids))
    new = cluster_tree(
        tree.ids[leaves],
        embeddings,
        [a[leaves] for a in tree.attrs],
        n_cluster=args.n_cluster,
        raw=[cfg.attr_fields.index(c) for c in raw],
        seed=args.seed,
    )
    out = write_tree(new, args.output_dir, cfg.attr_delimiter)
    print(f"clustered the {embeddings.shape[0]} items' {embeddings.shape[1]}-wide embeddings of step {trainer.step}")
    _print_tree(new, out, cfg.attr_fields)


def cmd_tdm_retrieve(args) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dynarec.data.batch import BatchBuilder, RowOrigin
    from dynarec.data.reader import read_table, resolve_files
    from dynarec.files import atomic_path
    from dynarec.serving import ExportedModel
    from dynarec.tdm import BeamSearch, config_tree

    model = ExportedModel(args.export_dir, device=args.device)
    config = model.config
    tree = config_tree(config)
    cfg = config.data.tdm_sampler
    assert cfg is not None
    builder = BatchBuilder(config, with_labels=False)

    def score(table):
        batch = builder.build(table, RowOrigin.of("the (user, tree node) rows of beam search", table.num_rows))
        return model.predict_batch(batch)["probability"].float().cpu().numpy()

    search = BeamSearch(config, tree, score, args.recall_num)
    if args.batch_size < 1:
        raise ValueError(f"--batch-size: at least 1 user row, got {args.batch_size}")
    files = resolve_files(args.input, "--input")
    if Path(args.output).is_dir():
        raise FileExistsError(f"--output {args.output} is a directory; retrieve writes one Parquet file")
    items, scores, truth = [], [], []
    for f in files:
        table = read_table(f, None, config.data.input_type, builder.csv_column_types())
        for start in range(0, table.num_rows, args.batch_size):
            users = table.slice(start, args.batch_size)
            found = search.search(users)
            items.append(found.items)
            scores.append(found.scores)
            if cfg.item_id_field in users.schema.names:
                truth.append(users.column(cfg.item_id_field).cast(pa.int64()).to_numpy(zero_copy_only=False))
    k = args.recall_num
    ids = np.concatenate(items) if items else np.zeros((0, k), np.int64)
    probs = np.concatenate(scores) if scores else np.zeros((0, k), np.float32)
    columns = {
        "recall_ids": pa.FixedSizeListArray.from_arrays(pa.array(ids.reshape(-1)), k),
        "recall_scores": pa.FixedSizeListArray.from_arrays(pa.array(probs.reshape(-1)), k),
    }
    line = f"retrieved {k} items for each of {len(ids)} rows to {args.output}"
    if truth and len(np.concatenate(truth)) == len(ids):
        gt = np.concatenate(truth)
        columns[cfg.item_id_field] = pa.array(gt)
        hits = (ids == gt[:, None]).any(axis=1)
        line += f"; recall@{k} (the row's {cfg.item_id_field} among them): {hits.mean():.4f}"
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(Path(args.output)) as tmp:
        pq.write_table(pa.table(columns), str(tmp))
    print(line)


def at_least(smallest: int) -> Callable[[str], int]:
    """An argparse type: an int of at least ``smallest`` (argparse names the option in its error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < smallest:
            raise argparse.ArgumentTypeError(f"{value} is below {smallest}")
        return value

    return parse


def seconds(text: str) -> float:
    """An argparse type: a finite number of seconds above 0 (argparse names the option)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a number of seconds above 0")
    return value


def _build_parser() -> argparse.ArgumentParser:
    from dynarec import bench, demo, verify

    parser = argparse.ArgumentParser(
        prog="dynarec", description="Recommendation models with fixed and dynamic embeddings."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "demo", help="generate data, train the demo MultiTowerDIN and a baseline, evaluate, export, predict"
    )
    demo.add_arguments(p)
    p.set_defaults(run=demo.main)

    p = sub.add_parser("make-data", help="write a synthetic click log (train/eval Parquet + meta.json)")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--config", help="write the columns this config reads (any config) instead of the demo's click log")
    p.add_argument("--train-rows", type=at_least(1), default=200_000, help="rows of the training files")
    p.add_argument("--eval-rows", type=at_least(1), default=40_000, help="rows of the evaluation file")
    p.add_argument("--num-users", type=at_least(1), help="distinct users (the demo's log; default 20,000)")
    p.add_argument("--num-items", type=at_least(1), help="distinct items (the demo's log; default 5,000)")
    p.add_argument("--seed", type=at_least(0), default=0, help="the generator's seed (the same seed, the same rows)")
    p.add_argument(
        "--max-sequence-length",
        type=at_least(1),
        help="with --config: a generated sequence holds 1 to this many elements a row, whatever its sequence_length "
        "(default 50)",
    )
    p.set_defaults(run=cmd_make_data)

    def common(p, model_dir_required=True):
        p.add_argument("--config", help="the YAML config (default: <model-dir>/config.yaml)")
        p.add_argument(
            "--model-dir", required=model_dir_required, help="the model directory (config.yaml, checkpoints, metrics)"
        )
        p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")

    p = sub.add_parser("plan", help="print the per-table plan of a config (sharding, bytes per rank, exchange)")
    common(p, model_dir_required=False)
    p.add_argument("--world-size", type=at_least(1), default=1, help="plan for this many processes")
    p.set_defaults(run=cmd_plan)

    p = sub.add_parser("import-config", help="convert a TorchEasyRec pipeline.config into a dynarec YAML config")
    p.add_argument("pipeline_config")
    p.add_argument("-o", "--output", required=True, help="the YAML file to write")
    p.add_argument("--train-input-path", help="replaces train_input_path (needed for odps:// tables)")
    p.add_argument("--eval-input-path", help="replaces eval_input_path")
    p.add_argument("--sampler-input-path", help="replaces data_config.negative_sampler.input_path (the item table)")
    p.add_argument(
        "--hard-negative-edge-path",
        help="replaces data_config.hard_negative_sampler.hard_neg_edge_input_path (the user -> item edge table)",
    )
    p.add_argument(
        "--tree-dir",
        help="replaces data_config.tdm_sampler's item_input_path and edge_input_path with this directory's "
        "node_table.txt and edge_table.txt (dynarec tdm init-tree writes them)",
    )
    p.add_argument("--lenient", action="store_true", help="drop the fields dynarec cannot carry, and list them")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace -o's file even where import-config did not write it, or it was edited since",
    )
    p.set_defaults(run=cmd_import_config)

    p = sub.add_parser(
        "verify", help="check every table's optimizer (weights and states, step by step) against the reference"
    )
    p.add_argument("--config", required=True)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    p.add_argument("--steps", type=at_least(1), default=8, help="training steps per table")
    p.set_defaults(run=verify.main)

    p = sub.add_parser("train", help="train with periodic eval and checkpoints")
    common(p)
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument("--no-progress", action="store_true", help="no progress bar or step lines (errors still print)")
    p.add_argument(
        "--follow",
        action="store_true",
        help="data.train_input_path is a directory receiving new files: train on them as they arrive",
    )
    p.add_argument("--poll-seconds", type=seconds, help="--follow: how often to look for new files (default: 5)")
    p.add_argument(
        "--idle-timeout", type=seconds, default=None, help="--follow: stop after this many seconds without a new file"
    )
    p.add_argument(
        "--nproc",
        type=at_least(1),
        default=1,
        help="processes on this host (a torchrun job); data.batch_size is per process",
    )
    p.set_defaults(run=cmd_train)

    p = sub.add_parser("evaluate", help="evaluate the latest checkpoint")
    common(p)
    p.add_argument("--input", nargs="+", help="data to evaluate (default: data.eval_input_path)")
    p.set_defaults(run=cmd_evaluate)

    p = sub.add_parser("export", help="export the latest checkpoint for serving")
    common(p)
    p.add_argument("--export-dir", required=True)
    p.add_argument(
        "--since",
        help="a previous export (full or delta) of this model, or of any with the same tables: write only "
        "the rows that differ from it (a delta)",
    )
    p.set_defaults(run=cmd_export)

    p = sub.add_parser("predict", help="score data from an export directory or a checkpoint")
    p.add_argument("--export-dir")
    p.add_argument("--model-dir")
    p.add_argument("--config")
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="files, directories or globs, read in path order (the output's rows follow it)",
    )
    p.add_argument(
        "--output",
        required=True,
        help="a Parquet file: column 'probability' (a multi-task model: probs_<task> / y_<task>), "
        "and the label columns the input holds",
    )
    p.add_argument(
        "--reserved-columns",
        help="input columns copied into the output beside each row's prediction, comma-separated (e.g. "
        "user_id,item_id: to join the predictions back; TorchEasyRec's predict --reserved_columns)",
    )
    p.set_defaults(run=cmd_predict)

    p = sub.add_parser("tdm", help="a TDM model's tree: build it, cluster it from a trained model, retrieve by it")
    tdm = p.add_subparsers(dest="tdm_command", required=True)
    q = tdm.add_parser("init-tree", help="TorchEasyRec's initial tree: items sorted by category, split n ways")
    q.add_argument("--items", nargs="+", required=True, help="the item table(s): one row an item")
    q.add_argument("--item-id-field", required=True)
    q.add_argument("--cate-id-field", required=True, help="the items' category column (the tree's first split)")
    q.add_argument("--attr-fields", help="item columns the nodes carry, comma-separated (voted up the tree)")
    q.add_argument("--raw-attr-fields", help="numeric item columns the nodes carry after them (averaged up the tree)")
    q.add_argument("--attr-delimiter", default=",")
    q.add_argument("--n-cluster", type=int, default=2, help="the tree's branching factor")
    q.add_argument("--output-dir", required=True)
    q.set_defaults(run=cmd_tdm_init_tree)
    q = tdm.add_parser("cluster-tree", help="a learnt tree: the items clustered by a trained model's embeddings")
    common(q)
    q.add_argument("--output-dir", required=True)
    q.add_argument("--n-cluster", type=int, default=2, help="the tree's branching factor")
    q.add_argument("--raw-attr-fields", help="which of data.tdm_sampler.attr_fields are numbers (averaged)")
    q.add_argument("--seed", type=at_least(0), default=0, help="k-means's seed")
    q.set_defaults(run=cmd_tdm_cluster_tree)
    q = tdm.add_parser("retrieve", help="beam search of each row's items down the tree, by an exported model")
    q.add_argument("--export-dir", required=True)
    q.add_argument("--input", nargs="+", required=True, help="the user rows (the model's columns)")
    q.add_argument("--output", required=True, help="a Parquet file: recall_ids and recall_scores, k a row")
    q.add_argument("--recall-num", type=int, required=True, help="items a row")
    q.add_argument("--batch-size", type=int, default=256, help="user rows searched together")
    q.add_argument("--device", default="cpu")
    q.set_defaults(run=cmd_tdm_retrieve)

    p = sub.add_parser("bench", help="run a benchmark (medians, with its baseline in the same run)")
    bench.add_arguments(p)
    p.set_defaults(run=bench.main)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _build_parser().parse_args(argv)
    args.argv = argv
    from dynarec.train.trainer import TrainingError

    if args.command == "predict" and bool(args.export_dir) == bool(args.model_dir):
        print("dynarec predict: error: give exactly one of --export-dir or --model-dir", file=sys.stderr)
        return 2
    if args.command == "predict" and args.export_dir and args.config:  # (it would be ignored)
        print(
            "dynarec predict: error: --config goes with --model-dir; an export directory carries the config it was "
            "exported with",
            file=sys.stderr,
        )
        return 2
    from dynarec.distributed.context import DistributedError, StepFailedError
    from dynarec.embedding.cached_store import CacheFullError
    from dynarec.embedding.dynamic import TableFullError
    from dynarec.files import DirectoryBusyError
    from dynarec.train.checkpoint import CheckpointError
    from dynarec.train.stop import TrainingStopped

    try:
        if getattr(args, "device", None):
            from dynarec.devices import check_device

            check_device(args.device)
        with _warnings_of(args.command):
            rc = args.run(args)  # a command that finds a problem without an error returns its status
    except (
        ValueError,
        FileNotFoundError,
        FileExistsError,
        CheckpointError,
        DirectoryBusyError,
        TrainingError,
        DistributedError,
        StepFailedError,
    ) as e:
        from dynarec.files import describe_os_error

        # (an OSError with an errno is the system's, not one of dynarec's messages: in words)
        message = describe_os_error(e) if isinstance(e, OSError) and e.errno is not None else str(e)
        print(f"dynarec {args.command}: error: {message}", file=sys.stderr)
        return 2
    except (TableFullError, CacheFullError) as e:  # mid-run: the step was undone
        note = _latest_note(args) if args.command == "train" else ""
        print(f"dynarec {args.command}: error: {e}{note}", file=sys.stderr)
        return 2
    except OSError as e:  # the environment refused a read or write: a full disk, a read-only target, ...
        from dynarec.files import describe_os_error

        note = _latest_note(args) if args.command == "train" else ""
        print(f"dynarec {args.command}: error: {describe_os_error(e)}{note}", file=sys.stderr)
        return 2
    except TrainingStopped as e:  # SIGTERM: the step finished and saved
        print(f"dynarec {args.command}: {e}", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print(f"dynarec {args.command}: interrupted{_latest_note(args)}", file=sys.stderr)
        return 130
    return rc if isinstance(rc, int) else 0


@contextlib.contextmanager
def _warnings_of(command: str) -> Iterator[None]:
    """dynarec's own warnings printed as ``dynarec <command>: warning: <message>``, as its errors
    are (Python's format adds the warning's source file and line, which tell a user nothing);
    other libraries' keep Python's format. (``warnings.formatwarning`` is the warnings module's
    hook for this; recording them, as a test's ``pytest.warns`` does, is unaffected.)"""
    import warnings

    package = str(Path(__file__).resolve().parent) + os.sep
    default = warnings.formatwarning

    def formatted(message, category, filename, lineno, line=None) -> str:
        if str(filename).startswith(package):
            return f"dynarec {command}: warning: {message}\n"
        return default(message, category, filename, lineno, line)

    warnings.formatwarning = formatted
    try:
        yield
    finally:
        warnings.formatwarning = default


def _latest_note(args) -> str:
    """'; the latest checkpoint is ...' for commands with a model directory."""
    model_dir = getattr(args, "model_dir", None)
    if not model_dir:
        return ""
    import warnings

    from dynarec.train.checkpoint import latest_checkpoint

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        latest = latest_checkpoint(Path(model_dir) / "checkpoints")
    if latest is None:
        return f"; {model_dir} holds no complete checkpoint"
    resume = "--follow --resume" if getattr(args, "follow", False) else "--resume"
    return f"; the latest checkpoint is {latest} (continue with {resume})"


if __name__ == "__main__":
    sys.exit(main())
