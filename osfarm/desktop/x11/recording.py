"""Screen recording with ffmpeg's x11grab, as OSWorld's /start_recording and /end_recording do.

One :class:`Recorder` per desktop. ``start`` returns once ffmpeg is really grabbing (it has
printed its output header), not after a fixed pause; ``stop`` sends SIGINT so ffmpeg finishes
the mp4 (moov atom) and returns the file path.

Thread-safety: every public method takes the recorder's lock, so the guest may call them from
any worker thread.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import threading
import time
from collections import deque
from pathlib import Path

from osfarm.errors import OsfarmError


class RecordingError(OsfarmError, RuntimeError):
    """Recording cannot start or stop; ``status`` is the HTTP status the guest should answer."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.message = message
        self.status = status


class Recorder:
    def __init__(self, display: str, size: tuple[int, int], out_dir: str | Path,
                 env: dict[str, str] | None = None, framerate: int = 30):
        self.display = display
        self.size = size
        self.path = Path(out_dir) / "recording.mp4"
        self.env = env
        self.framerate = framerate
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: deque[str] = deque(maxlen=40)
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, ready_timeout: float = 15.0) -> None:
        with self._lock:
            if self.active:
                raise RecordingError("Recording is already in progress.", 400)
            ffmpeg = shutil.which("ffmpeg")
            if ffmpeg is None:
                raise RecordingError("ffmpeg is not installed in this desktop", 500)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.unlink(missing_ok=True)
            w, h = self.size
            cmd = [
                ffmpeg, "-hide_banner", "-nostdin", "-y",
                "-f", "x11grab", "-draw_mouse", "1", "-framerate", str(self.framerate),
                "-video_size", f"{w}x{h}", "-i", f"{self.display}.0",
                # ultrafast: the desktop shares its CPU with the apps being recorded.
                "-c:v", "libx264", "-preset", "ultrafast", "-pix_fmt", "yuv420p",
                str(self.path),
            ]
            self._log.clear()
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, env=self.env)
            started = threading.Event()
            threading.Thread(target=self._read_log, args=(proc, started), daemon=True,
                             name="ffmpeg-log").start()
            deadline = time.monotonic() + ready_timeout
            while not started.wait(0.02):
                if proc.poll() is not None or time.monotonic() > deadline:
                    if proc.poll() is None:
                        proc.kill()
                    proc.wait()
                    tail = " | ".join(list(self._log)[-5:])
                    raise RecordingError(f"Failed to start recording. ffmpeg: {tail}", 500)
            self._proc = proc

    def _read_log(self, proc: subprocess.Popen[bytes], started: threading.Event) -> None:
        assert proc.stderr is not None
        # ffmpeg ends progress lines with \r; split on both so "frame=" shows up promptly.
        buf = b""
        while True:
            chunk = proc.stderr.read1(4096)  # type: ignore[attr-defined]
            if not chunk:
                break
            buf += chunk
            parts = buf.replace(b"\r", b"\n").split(b"\n")
            buf = parts.pop()
            for line in parts:
                text = line.decode(errors="replace").strip()
                if not text:
                    continue
                self._log.append(text)
                if text.startswith("Output #0") or text.startswith("frame="):
                    started.set()

    def stop(self, timeout: float = 15.0) -> Path:
        """Stop recording and return the mp4; raises RecordingError if none is running."""
        with self._lock:
            proc, self._proc = self._proc, None
            if proc is None or proc.poll() is not None:
                raise RecordingError("No recording in progress to stop.", 400)
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise RecordingError("ffmpeg did not stop on SIGINT and was killed", 500) from None
            if not self.path.exists() or self.path.stat().st_size == 0:
                tail = " | ".join(list(self._log)[-5:])
                raise RecordingError(f"Recording failed: output file is missing or empty. ffmpeg: {tail}", 500)
            return self.path

    def close(self) -> None:
        """Kill a running ffmpeg (session shutdown)."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
