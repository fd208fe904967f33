#!/usr/bin/env bash
# Writes the test-only PKI of tests/worker_tls.rs into tests/data/tls/ (or $1): a CA, a
# worker certificate for localhost/127.0.0.1 and a client certificate signed by it, and a
# second, unrelated CA with a client certificate of its own that the worker must refuse.
# EC P-256 keys, 100 years of validity, so the committed files never expire under CI.
# Never use these for anything but tests: their private keys are public.
set -euo pipefail

out="${1:-$(cd "$(dirname "$0")/.." && pwd)/tests/data/tls}"
days=36500
mkdir -p "$out"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

new_key() {
    openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null
}

# new_ca NAME SUBJECT: a self-signed CA certificate NAME.pem, its key NAME.key in $work.
new_ca() {
    new_key "$work/$1.key"
    openssl req -x509 -new -key "$work/$1.key" -sha256 -days "$days" -subj "$2" \
        -addext "basicConstraints=critical,CA:TRUE" \
        -addext "keyUsage=critical,keyCertSign,cRLSign" \
        -out "$out/$1.pem"
}

# new_leaf NAME CA SUBJECT EXTENSIONS: NAME.pem and NAME.key, signed by CA.
new_leaf() {
    new_key "$out/$1.key"
    openssl req -new -key "$out/$1.key" -subj "$3" -out "$work/$1.csr"
    printf '%s\n' "basicConstraints=critical,CA:FALSE" \
        "keyUsage=critical,digitalSignature" "$4" >"$work/$1.ext"
    openssl x509 -req -in "$work/$1.csr" -CA "$out/$2.pem" -CAkey "$work/$2.key" \
        -CAcreateserial -CAserial "$work/$2.srl" -sha256 -days "$days" \
        -extfile "$work/$1.ext" -out "$out/$1.pem" 2>/dev/null
}

new_ca ca "/CN=tether test CA"
new_leaf worker ca "/CN=tether test worker" \
    "$(printf '%s\n' "extendedKeyUsage=serverAuth" "subjectAltName=DNS:localhost,IP:127.0.0.1")"
new_leaf client ca "/CN=tether test coordinator" \
    "$(printf '%s\n' "extendedKeyUsage=clientAuth" "subjectAltName=DNS:tether-coordinator")"

new_ca rogue-ca "/CN=tether rogue test CA"
new_leaf rogue-client rogue-ca "/CN=tether rogue coordinator" \
    "$(printf '%s\n' "extendedKeyUsage=clientAuth" "subjectAltName=DNS:tether-coordinator")"

openssl verify -CAfile "$out/ca.pem" "$out/worker.pem" "$out/client.pem" >/dev/null
openssl verify -CAfile "$out/rogue-ca.pem" "$out/rogue-client.pem" >/dev/null
echo "wrote test certificates to $out"
