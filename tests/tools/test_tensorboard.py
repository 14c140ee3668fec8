#!/usr/bin/python3
"""metrics.tensorboard's event files, read by readers that are not ours
(registered in tests/tools/CMakeLists.txt).

  test_tensorboard.py --train TRAIN --source SOURCE_DIR

Trains 6 steps on 2 ranks with metrics.tensorboard (checkpoints at 2, 4, 6),
removes the step-6 checkpoint as if the run had died before committing it,
and resumes to step 8: steps 5 and 6 are logged twice, once by each run.

Each file is read record by record: TFRecord framing with both CRCs checked
by python3-crc32c (Google's CRC-32C, not ours), each record parsed as
tensorflow.Event by python3-protobuf, from the message definitions
TensorFlow publishes (tensorflow/core/util/event.proto,
tensorflow/core/framework/summary.proto; the fields used, with their
numbers), built here as descriptors because Debian packages neither
TensorBoard nor TensorFlow's protos. Then TensorBoard's own rule for a
restart is applied (a SessionLog START at step S drops the earlier files'
events at S and later, in file-name order): every step appears once, with
metrics.jsonl's value (float32) of the run that logged it last.

Nothing is skipped: without python3-protobuf or python3-crc32c the test
fails, saying what to install (scripts/bootstrap.sh installs both).
"""
import argparse
import glob
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

try:
    import crc32c
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
except ImportError as e:
    sys.exit(f"test_tensorboard: {e}: install python3-protobuf and python3-crc32c (scripts/bootstrap.sh)")


def event_class():
    """tensorflow.Event and what it holds, as TensorFlow defines them."""
    f = descriptor_pb2.FileDescriptorProto(name="shardkit_tf_event.proto", package="tensorflow",
                                           syntax="proto3")
    T = descriptor_pb2.FieldDescriptorProto

    def message(name, fields):
        m = f.message_type.add(name=name)
        for fname, number, ftype, label, type_name in fields:
            fd = m.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                fd.type_name = type_name
        return m

    opt, rep = T.LABEL_OPTIONAL, T.LABEL_REPEATED
    message("SummaryValue", [("tag", 1, T.TYPE_STRING, opt, None),
                             ("simple_value", 2, T.TYPE_FLOAT, opt, None)])
    message("Summary", [("value", 1, T.TYPE_MESSAGE, rep, ".tensorflow.SummaryValue")])
    enum = f.enum_type.add(name="SessionStatus")
    for name, number in [("STATUS_UNSPECIFIED", 0), ("START", 1), ("STOP", 2), ("CHECKPOINT", 3)]:
        enum.value.add(name=name, number=number)
    message("SessionLog", [("status", 1, T.TYPE_ENUM, opt, ".tensorflow.SessionStatus"),
                           ("checkpoint_path", 2, T.TYPE_STRING, opt, None),
                           ("msg", 3, T.TYPE_STRING, opt, None)])
    message("Event", [("wall_time", 1, T.TYPE_DOUBLE, opt, None),
                      ("step", 2, T.TYPE_INT64, opt, None),
                      ("file_version", 3, T.TYPE_STRING, opt, None),
                      ("summary", 5, T.TYPE_MESSAGE, opt, ".tensorflow.Summary"),
                      ("session_log", 6, T.TYPE_MESSAGE, opt, ".tensorflow.SessionLog")])
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    desc = pool.FindMessageTypeByName("tensorflow.Event")
    if hasattr(message_factory, "GetMessageClass"):
        return message_factory.GetMessageClass(desc)
    return message_factory.MessageFactory(pool).GetPrototype(desc)


def masked(data):
    c = crc32c.crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def read_events(path, Event):
    """Every record of a file, its CRCs checked, parsed as an Event."""
    data = open(path, "rb").read()
    events, at = [], 0
    while at < len(data):
        assert at + 12 <= len(data), f"{path}: truncated record header at byte {at}"
        length_bytes = data[at:at + 8]
        (length,) = struct.unpack("<Q", length_bytes)
        (length_crc,) = struct.unpack("<I", data[at + 8:at + 12])
        assert length_crc == masked(length_bytes), f"{path}: length CRC mismatch at byte {at}"
        body = data[at + 12:at + 12 + length]
        (body_crc,) = struct.unpack("<I", data[at + 12 + length:at + 16 + length])
        assert body_crc == masked(body), f"{path}: data CRC mismatch at byte {at}"
        event = Event()
        event.ParseFromString(body)
        events.append(event)
        at += 16 + length
    return events


def tensorboard_view(paths, Event):
    """(tag -> {step: value}) as TensorBoard shows it: files in name order,
    a SessionLog START at step S dropping what came before at S and later."""
    seen = []  # (step, tag, value) in reading order
    starts = 0
    for path in paths:
        events = read_events(path, Event)
        assert events and events[0].file_version == "brain.Event:2", f"{path}: no file_version first"
        for e in events:
            if e.HasField("session_log") and e.session_log.status == 1:
                starts += 1
                seen = [s for s in seen if s[0] < e.step]
            for v in e.summary.value:
                seen.append((e.step, v.tag, v.simple_value))
    view = {}
    for step, tag, value in seen:
        per_tag = view.setdefault(tag, {})
        assert step not in per_tag, f"tag {tag} has step {step} twice after the purge"
        per_tag[step] = value
    return view, starts


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--source", required=True)
    a = ap.parse_args()
    Event = event_class()
    tmp = tempfile.mkdtemp(prefix="shardkit_tb_")
    try:
        run_dir = os.path.join(tmp, "run")
        base = [a.train, "--nproc", "2", "--config", os.path.join(a.source, "configs/default.yaml"),
                "--set", f"run.dir={run_dir}", "--set", "train.log_every=1", "--set", "train.eval_every=4",
                "--set", "checkpoint.interval=2", "--set", "checkpoint.mode=sync",
                "--set", "metrics.tensorboard=true", "--set", "train.peak_tflops=1"]
        for steps in (6, 8):
            r = subprocess.run(base + ["--set", f"train.steps={steps}"], capture_output=True, text=True)
            assert r.returncode == 0, f"train exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
            if steps == 6:  # died before step 6's checkpoint committed
                shutil.rmtree(os.path.join(run_dir, "checkpoints", "step_6"))
        assert "resumed from" in r.stdout and "step 4" in r.stdout, r.stdout

        files = sorted(glob.glob(os.path.join(run_dir, "tb", "events.out.tfevents.*")))
        assert len(files) == 2, files
        view, starts = tensorboard_view(files, Event)
        assert starts == 1, f"{starts} SessionLog START events; one expected (the resume's)"

        last = {}  # metrics.jsonl: the value of each step's last record
        evals = {}
        for line in open(os.path.join(run_dir, "metrics.jsonl")):
            rec = json.loads(line)
            if "event" not in rec:
                last[rec["step"]] = rec
            elif rec["event"] == "eval":
                evals[rec["step"]] = rec["val_loss"]
        assert sorted(view["loss"]) == list(range(1, 9)), sorted(view["loss"])
        for tag in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu_percent"):
            for step, value in view[tag].items():
                assert value == f32(last[step][tag]), (tag, step, value, last[step][tag])
        assert sorted(view["val_loss"]) == [4, 8], view["val_loss"]
        for step, value in view["val_loss"].items():
            assert value == f32(evals[step]), (step, value, evals[step])
        assert sorted(view["memory/peak_rss_mib"]) == list(range(1, 9))
        # Steps 2 and 4 of the first run and 6 and 8 of the second; the
        # first run's step 6 was dropped with the rest of its steps >= 5.
        assert sorted(view["checkpoint/blocking_s"]) == [2, 4, 6, 8], view["checkpoint/blocking_s"]
        print(f"test_tensorboard: OK: {len(files)} files, {sum(len(v) for v in view.values())} scalars "
              f"under {len(view)} tags, every record's CRCs checked")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
