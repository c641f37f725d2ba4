package main

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"time"

	"github.com/streamq/streamq"
)

// flowChildren is the number of children of each flow in the flow scenario.
const flowChildren = 10

// runFlow measures flows: n children in flows of ten (n/10 parents), all on
// one queue. P producers with -callers goroutines each call ProduceFlow and
// Wait for the parent, whose handler reads its children's outcomes
// (Message.Children). jobs/s and the Redis CPU are per child (the parents'
// cost included); latency: ProduceFlow to the parent's outcome. There is no
// baseline: a hand-written equivalent would be this design again.
func runFlow(ctx context.Context, e *env, n int) error {
	parents := max(n/flowChildren, 1)
	n = parents * flowChildren
	q := e.queue("flow", "streamq")
	pad := padFor(e.cfg.payload)
	kids := newTracker(n)
	tops := newTracker(parents)
	var herr handlerErrors
	handler := func(ctx context.Context, m *streamq.Message[job]) (int, error) {
		if !strings.HasPrefix(m.ID, "f") {
			if err := kids.mark(m.Payload.Seq, 0); err != nil {
				herr.add(err)
			}
			return m.Payload.Seq, nil
		}
		cs, err := m.Children(ctx)
		if err != nil {
			return 0, err
		}
		if len(cs) != flowChildren {
			herr.add(fmt.Errorf("parent %s saw %d children", m.ID, len(cs)))
		}
		for _, c := range cs {
			if c.Err != nil {
				herr.add(fmt.Errorf("parent %s: child %s: %w", m.ID, c.ID, c.Err))
			}
		}
		if err := tops.mark(m.Payload.Seq, 0); err != nil {
			herr.add(err)
		}
		return m.Payload.Seq, nil
	}
	cs, err := startConsumers(ctx, e, q, handler, consumerOpts(e, streamq.ConsumerOptions{}))
	if err != nil {
		return err
	}
	defer cs.stop()
	def := streamq.NewQueue[job, int](q)
	producers := make([]*streamq.Producer[job, int], e.cfg.producers)
	for i := range producers {
		cl := e.client(0)
		defer cl.Close()
		p, err := def.NewProducer(cl, &streamq.ProducerOptions{Logger: e.log})
		if err != nil {
			return err
		}
		defer p.Close()
		producers[i] = p
	}
	rtt := make([]int64, parents)
	m := e.meter()
	if err := m.start(ctx); err != nil {
		return err
	}
	var next atomic.Int64
	var g errGroup
	for _, p := range producers {
		for range e.cfg.callers {
			g.Go(func() error {
				children := make([]streamq.Child, flowChildren)
				for {
					i := int(next.Add(1) - 1)
					if i >= parents {
						return nil
					}
					t0 := time.Now()
					for j := range children {
						k := i*flowChildren + j
						children[j] = streamq.ChildOf(def, jobID(k), job{Seq: k, T: t0.UnixNano(), Pad: pad})
					}
					pr, err := p.ProduceFlow(ctx, fmt.Sprintf("f%d", i), job{Seq: i, T: t0.UnixNano()}, children, nil)
					if err != nil {
						return fmt.Errorf("ProduceFlow: %w", err)
					}
					wctx, cancel := context.WithTimeout(ctx, time.Minute)
					got, err := pr.Wait(wctx)
					cancel()
					if err != nil {
						return fmt.Errorf("Wait f%d: %w", i, err)
					}
					rtt[i] = int64(time.Since(t0))
					if got != i {
						return fmt.Errorf("flow %d got the result of flow %d", i, got)
					}
				}
			})
		}
	}
	if err := g.Wait(); err != nil {
		return err
	}
	if err := finish(ctx, e, m, kids, streamKey(q), streamq.DefaultGroup); err != nil {
		return err
	}
	if err := cs.stop(); err != nil {
		return err
	}
	if err := checkEmpty(ctx, e, streamKey(q)); err != nil {
		return err
	}
	if err := firstErr(herr.err(), kids.verify("streamq flow children"), tops.verify("streamq flow parents")); err != nil {
		return err
	}
	e.out.result(m.result("flow", "streamq", n, "flow round trip", rtt))
	return nil
}
