"""A TCP relay for fault tests: it forwards island <-> syncer traffic and cuts the first connection once a given
number of bytes went upstream (in the middle of whatever message is passing), as a dropped WAN link would; later
connections pass untouched."""
import socket
import threading


class CutLink:
    def __init__(self, target_port, cut_after_bytes, host="127.0.0.1"):
        self.target = (host, target_port)
        self.cut_after = cut_after_bytes
        self.cuts = 0
        self.connections = 0
        self.lock = threading.Lock()
        self.srv = socket.create_server((host, 0))
        self.port = self.srv.getsockname()[1]
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.closed:
            try:
                a, _ = self.srv.accept()
            except OSError:
                return
            try:
                b = socket.create_connection(self.target, timeout=10)
            except OSError:
                a.close()   # the syncer is not there: the island sees a refused/dropped connection
                continue
            with self.lock:
                self.connections += 1
                cut = self.cut_after if self.connections == 1 else None
            state = {"up": 0}
            threading.Thread(target=self._pump, args=(a, b, cut, state), daemon=True).start()
            threading.Thread(target=self._pump, args=(b, a, None, state), daemon=True).start()

    def _pump(self, src, dst, cut, state):
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if cut is not None and state["up"] + len(data) > cut:
                    keep = cut - state["up"]
                    if keep > 0:
                        dst.sendall(data[:keep])
                    with self.lock:
                        self.cuts += 1
                    break
                if cut is not None:
                    state["up"] += len(data)
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):   # one side gone: the whole connection goes (RST/FIN to both ends)
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self):
        self.closed = True
        self.srv.close()
