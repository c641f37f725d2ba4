package main

import (
	"context"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq/internal/redistest"
)

func usec(ctx context.Context, c *redis.Client) (calls, us float64) {
	s := c.Info(ctx, "commandstats").Val()
	for _, l := range strings.Split(s, "\n") {
		if strings.HasPrefix(l, "cmdstat_evalsha:") {
			for _, f := range strings.Split(strings.TrimSpace(strings.TrimPrefix(l, "cmdstat_evalsha:")), ",") {
				kv := strings.SplitN(f, "=", 2)
				v, _ := strconv.ParseFloat(kv[1], 64)
				switch kv[0] {
				case "calls":
					calls = v
				case "usec":
					us = v
				}
			}
		}
	}
	return
}

func main() {
	ctx := context.Background()
	p, err := redistest.StartProcess(ctx)
	if err != nil {
		panic(err)
	}
	defer p.Stop()
	c := redis.NewClient(&redis.Options{Addr: p.Addr()})
	oldSrc, _ := os.ReadFile(os.Args[1])
	newSrc, _ := os.ReadFile(os.Args[2])
	scripts := []*redis.Script{redis.NewScript(string(oldSrc)), redis.NewScript(string(newSrc))}
	const n = 50
	q := "{q}"
	stream := "streamq:" + q + ":stream"
	c.XGroupCreateMkStream(ctx, stream, "g", "0")
	keys := []string{stream, "streamq:" + q + ":dead", "streamq:" + q + ":fanout"}
	args := []any{"g", "streamq:" + q + ":done", 60000, "1", 1000, "me", time.Now().UnixMilli(), "PUBLISH", "0"}
	for i := range n {
		keys = append(keys, fmt.Sprintf("streamq:%s:id:%d", q, i))
		args = append(args, fmt.Sprintf("%d-1", i+1), strconv.Itoa(i), "R", `"ok"`, "", 1)
	}
	keys = append(keys, "streamq:"+q+":starts:g")
	var tot [2][2]float64
	var ratios []float64
	for round := 0; round < 60; round++ {
		var per [2]float64
		for si, s := range scripts {
			// fresh records each round: first writers
			for i := range n {
				c.Set(ctx, fmt.Sprintf("streamq:%s:id:%d", q, i), "P1-1", 0)
			}
			c0, u0 := usec(ctx, c)
			for range 200 {
				if err := s.Run(ctx, c, keys, args...).Err(); err != nil {
					panic(err)
				}
			}
			c1, u1 := usec(ctx, c)
			tot[si][0] += c1 - c0
			tot[si][1] += u1 - u0
			per[si] = (u1 - u0) / (c1 - c0)
		}
		ratios = append(ratios, per[1]/per[0])
	}
	sort.Float64s(ratios)
	fmt.Printf("median new/base per call: %.4f (quartiles %.4f %.4f)\n", ratios[len(ratios)/2], ratios[len(ratios)/4], ratios[3*len(ratios)/4])
	for si, name := range []string{"base", "new"} {
		fmt.Printf("%s: %.0f calls of %d items, %.2f us/call, %.3f us/item\n", name, tot[si][0], n, tot[si][1]/tot[si][0], tot[si][1]/tot[si][0]/n)
	}
}
