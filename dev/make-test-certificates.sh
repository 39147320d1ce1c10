#!/usr/bin/env bash
# Makes the certificates the TLS tests and benchmarks use (docs/security.md), with openssl:
#
#   dev/make-test-certificates.sh DIR
#
# DIR/ca.pem and ca.key: a CA (ECDSA P-256, valid 2 days); DIR/server.pem and server.key:
# a server certificate it signed for localhost and 127.0.0.1 (valid 1 day). For loopback
# tests only: nothing here is a secret.
set -euo pipefail
dir=${1:?usage: dev/make-test-certificates.sh DIR}
mkdir -p "$dir"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout "$dir/ca.key" -out "$dir/ca.pem" \
  -days 2 -subj "/CN=entitlements test CA" 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout "$dir/server.key" -out "$dir/server.csr" \
  -subj "/CN=localhost" 2>/dev/null
printf "subjectAltName=DNS:localhost,IP:127.0.0.1\n" > "$dir/server.ext"
openssl x509 -req -in "$dir/server.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" -CAcreateserial -out "$dir/server.pem" \
  -days 1 -extfile "$dir/server.ext" 2>/dev/null
rm -f "$dir/server.csr" "$dir/server.ext" "$dir/ca.srl"
