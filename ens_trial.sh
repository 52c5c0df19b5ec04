#!/bin/bash
# ens_trial N MARGIN
B=/tmp/attack/baton; n=$1; M=${2:-100ms}; export JOBLOG=/tmp/zkattack/ens$n.beats; rm -f $JOBLOG
$B run --backend zk://127.0.0.1:24959/ens --election e$n --id A --ttl 3s --safety-margin $M -- /tmp/zkattack/job.sh 2>/tmp/zkattack/ensA$n.err & PA=$!; echo "baton ensA $PA" >> /tmp/zkattack/PIDS
sleep 1.5
$B run --backend zk://127.0.0.1:24951/ens --election e$n --id B --ttl 3s --safety-margin $M -- /tmp/zkattack/job.sh 2>/tmp/zkattack/ensB$n.err & PB=$!; echo "baton ensB $PB" >> /tmp/zkattack/PIDS
sleep 1.$((RANDOM%10))
touch /tmp/zkattack/ARM; sleep 6
kill -CONT $(cat /tmp/zkattack/e1/pid)
kill -TERM $PA $PB 2>/dev/null; sleep 1.5
python3 /tmp/zkattack/check.py $JOBLOG | grep -E 'gap|OVERLAP|BAD|OK' | tr '\n' ' '; echo
