"""What persist.lua costs Redis per command, by Redis's own count.

Starts a redis-server on a free port, gives 30,000 rigs a lease and a session (as a hello
would), then keeps one command for each through persist.lua (or the script named as the
first argument) in calls of 500, as the bridge does (PERSIST_CHUNK), and forgets them with
pipelined HDELs as acks do. Prints INFO commandstats and Redis's CPU per command.

    python3 bench/results/persist-cost/persist_cost.py [script.lua]
"""
import socket, subprocess, time, os, sys, json, random
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '../../../tests/faults'))
from faults import Resp, free_port
port = free_port()
p = subprocess.Popen(['redis-server', '--port', str(port), '--save', '', '--appendonly', 'no'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
for _ in range(100):
    try:
        r = Resp(port); break
    except Exception: time.sleep(0.05)
def cpu():
    f = open(f'/proc/{p.pid}/stat').read().split(')')[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf('SC_CLK_TCK')
src = open(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), '../../../lua/persist.lua')).read()
try:
  sha = r.cmd('SCRIPT', 'LOAD', src)
  N = 30000
  boot = '019a0000-0000-7000-8000-000000000000'
  rigs = [f'rig-{i:05d}' for i in range(N)]
  for i in range(0, N, 1000):
      args = []
      for rg in rigs[i:i+1000]: args += [f'rig:{rg}', f'{boot}|b1']
      r.cmd('MSET', *args)
      r.pipeline([('HSET', f'sess:{rg}:{boot}', 'next', '1') for rg in rigs[i:i+1000]])
      r.pipeline([('PEXPIRE', f'sess:{rg}:{boot}', '600000') for rg in rigs[i:i+1000]])
  cmd = json.dumps({"type":"command","seq":1,"id":"c-0000000001","name":"reboot","args":{"delay_s":5,"reason":"bench"}})
  r.cmd('CONFIG', 'RESETSTAT')
  c0 = cpu(); t0 = time.time()
  for i in range(0, N, 500):
      keys = []; argv = ['600000']
      for rg in rigs[i:i+500]:
          keys += [f'rig:{rg}', f'sess:{rg}:{boot}']
          argv += [f'{boot}|b1', '1', cmd]
      r.cmd('EVALSHA', sha, str(len(keys)), *keys, *argv)
  c1 = cpu()
  # forgets: HDEL pipelined
  s = r.sock if hasattr(r, 'sock') else None
  for i in range(0, N, 1000):
      r.pipeline([('HDEL', f'sess:{rg}:{boot}', 'c:1') for rg in rigs[i:i+1000]])
  c2 = cpu()
  st = r.cmd('INFO', 'commandstats')
  print(st if isinstance(st, str) else st.decode())
  print(f'persist: redis cpu {c1-c0:.3f}s = {(c1-c0)/N*1e6:.1f} us/cmd; hdel (pipelined) {c2-c1:.3f}s = {(c2-c1)/N*1e6:.1f} us/cmd')
finally:
  p.terminate(); p.wait()
