#!/usr/bin/env bash
# Prints what a failed test run leaves to diagnose it: the machine's memory, the processes holding the most of it,
# and the kernel's last out-of-memory kills where the kernel log is readable.
free -m || true
ps -eo pid,ppid,rss,etimes,args --sort=-rss --no-headers 2>/dev/null | head -8 | cut -c1-160 || true
dmesg 2>/dev/null | grep -iE "out of memory|oom-kill|killed process" | tail -5 || true
