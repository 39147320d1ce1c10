#!/usr/bin/env python3
"""Writes the seed corpora in fuzz/corpus/ (committed; rerun only to change them).

Needs protoc (for message encodings) and a built `entitlements` (for the snapshot seed):
    python3 fuzz/make-seeds.py .build/debug/entitlements
"""
import os, struct, subprocess, sys

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
corpus = os.path.join(root, "fuzz", "corpus")
protos = ["entitlements/v1/types.proto", "entitlements/v1/service.proto", "entitlements/v1/storage.proto"]

def encode(message, text):
    return subprocess.run(["protoc", "-I", os.path.join(root, "proto"), "--encode=entitlements.v1." + message] + protos,
                          input=text.encode(), capture_output=True, check=True).stdout

def frame(kind, request_id, payload=b"", method=0, status=0, flags=0, timeout=0):
    return struct.pack(">HBBBBHQII", 0x454E, 1, kind, flags, status, method, request_id, timeout, len(payload)) + payload

def crc32c(data, crc=0):
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF

def write(folder, name, data):
    with open(os.path.join(corpus, folder, name), "wb") as f:
        f.write(data)

check = encode("CheckEntitlementsRequest", 'user_id: "user-1" entitlement_ids: "premium" at: 1767225600000 environment: ENVIRONMENT_SANDBOX')
batch = encode("BatchCheckEntitlementsRequest", 'user_ids: "a" user_ids: "b" entitlement_ids: "pro"')
grant = encode("GrantEntitlementRequest", 'user_id: "u" grant { grant_id: "g" entitlement_id: "premium" granted_date: 1 }')
response = encode("CheckEntitlementsResponse", 'user_id: "u" customer_id: "u" request_date: 5 valid_until: 9 entitlements { id: "premium" is_active: true source: SOURCE_STRIPE transactions { transaction_id: "t" type: TRANSACTION_TYPE_TRIAL_STARTED } }')

# Frames: the first byte is the chunk size the target feeds the decoder.
write("frames", "request", bytes([7]) + frame(1, 1, check, method=1, timeout=50000))
write("frames", "pipeline", bytes([3]) + frame(1, 1, check, method=1) + frame(5, 1) + frame(6, 9) + frame(1, 2, batch, method=2))
write("frames", "answers", bytes([31]) + frame(2, 1, response, flags=1) + frame(2, 2, b"user_id: must not be empty", status=3) + frame(8, 2, b"bye") + frame(9, 0, b"bad", status=3))
write("frames", "empty-payload", bytes([1]) + frame(1, 3, b"", method=4))

# Messages: the first byte picks the message type (see FuzzMessages).
write("messages", "check", bytes([0]) + check)
write("messages", "batch", bytes([1]) + batch)
write("messages", "grant", bytes([6]) + grant)
write("messages", "response", bytes([11]) + response)

# A write-ahead log with two batches.
def log_batch(records):
    payload = b"".join(struct.pack("<I", len(r)) + r for r in records)
    return struct.pack("<II", len(payload), crc32c(payload)) + payload
record1 = encode("LogRecord", 'sequence: 1 recorded_date: 5 grant_entitlement { user_id: "u" grant { grant_id: "g" entitlement_id: "premium" granted_date: 1 } }')
record2 = encode("LogRecord", 'sequence: 2 recorded_date: 6 delete_customer { user_id: "u" }')
write("log", "two-batches", b"ENTWAL\x00\x00" + struct.pack("<II", 1, 0) + log_batch([record1]) + log_batch([record2]))

# Format 2: the batch header carries a masked checksum of its first 8 bytes.
def log_batch_v2(records):
    payload = b"".join(struct.pack("<I", len(r)) + r for r in records)
    head = struct.pack("<II", len(payload), crc32c(payload))
    return head + struct.pack("<I", crc32c(head) ^ 0xA282EAD8) + payload
write("log", "two-batches-v2", b"ENTWAL\x00\x00" + struct.pack("<II", 2, 0) + log_batch_v2([record1]) + log_batch_v2([record2, record1]))
write("log", "torn-v2", b"ENTWAL\x00\x00" + struct.pack("<II", 2, 0) + log_batch_v2([record1]) + log_batch_v2([record2])[:-3])

# A snapshot of three synthetic customers.
if len(sys.argv) > 1:
    path = os.path.join(corpus, "snapshot", "three-customers")
    if os.path.exists(path):
        os.remove(path)
    subprocess.run([sys.argv[1], "snapshot", "generate", "--customers", "3", "--seed", "1",
                    "--now", "2026-11-22T00:00:00Z", "--output", path], check=True, capture_output=True)
