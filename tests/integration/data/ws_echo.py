"""A WebSocket echo server on the standard library only (RFC 6455: handshake, masked
client frames, fragmented messages, ping, close), for tests that run it inside a sandbox.

Usage: python3 ws_echo.py PORT
"""

import base64
import hashlib
import socket
import struct
import sys
import threading

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


def read_exact(conn, n):
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def read_frame(conn):
    b1, b2 = read_exact(conn, 2)
    fin, opcode, masked, length = b1 & 0x80, b1 & 0x0F, b2 & 0x80, b2 & 0x7F
    if length == 126:
        (length,) = struct.unpack("!H", read_exact(conn, 2))
    elif length == 127:
        (length,) = struct.unpack("!Q", read_exact(conn, 8))
    mask = read_exact(conn, 4) if masked else b"\0\0\0\0"
    payload = bytearray(read_exact(conn, length))
    for i in range(length):
        payload[i] ^= mask[i % 4]
    return bool(fin), opcode, bytes(payload)


def send_frame(conn, opcode, payload):
    head = bytes([0x80 | opcode])
    n = len(payload)
    if n < 126:
        head += bytes([n])
    elif n < 65536:
        head += bytes([126]) + struct.pack("!H", n)
    else:
        head += bytes([127]) + struct.pack("!Q", n)
    conn.sendall(head + payload)


def serve(conn):
    try:
        request = b""
        while b"\r\n\r\n" not in request:
            chunk = conn.recv(4096)
            if not chunk:
                return
            request += chunk
        headers = {}
        for line in request.split(b"\r\n")[1:]:
            if b":" in line:
                k, v = line.split(b":", 1)
                headers[k.strip().lower()] = v.strip()
        key = headers.get(b"sec-websocket-key")
        if key is None:
            body = b"not a websocket request\n"
            conn.sendall(
                b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
            )
            return
        accept = base64.b64encode(hashlib.sha1(key + GUID).digest())
        extra = b""
        if b"sec-websocket-protocol" in headers:
            extra = (
                b"Sec-WebSocket-Protocol: "
                + headers[b"sec-websocket-protocol"].split(b",")[0].strip()
                + b"\r\n"
            )
        conn.sendall(
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Accept: " + accept + b"\r\n" + extra + b"\r\n"
        )
        message, kind = b"", 0
        while True:
            fin, opcode, payload = read_frame(conn)
            if opcode == 8:
                send_frame(conn, 8, payload[:2])
                return
            if opcode == 9:
                send_frame(conn, 10, payload)
                continue
            if opcode in (1, 2):
                message, kind = payload, opcode
            elif opcode == 0:
                message += payload
            if fin and kind:
                send_frame(conn, kind, message)
                message, kind = b"", 0
    except (EOFError, OSError):
        pass
    finally:
        conn.close()


def main():
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", int(sys.argv[1])))
    srv.listen(64)
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


if __name__ == "__main__":
    main()
