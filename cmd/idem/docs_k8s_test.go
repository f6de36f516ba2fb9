package main

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"
)

// proxyFlagNames are the flags idem proxy -h lists.
func proxyFlagNames(t *testing.T) map[string]bool {
	t.Helper()
	var out, errb bytes.Buffer
	if code := run(context.Background(), []string{"proxy", "-h"}, &out, &errb); code != 0 {
		t.Fatalf("idem proxy -h: exit %d\n%s", code, errb.String())
	}
	flags := map[string]bool{}
	for _, m := range regexp.MustCompile(`(?m)^  -([a-z0-9-]+)`).FindAllStringSubmatch(out.String()+errb.String(), -1) {
		flags[m[1]] = true
	}
	if !flags["upstream"] || !flags["shutdown-timeout"] {
		t.Fatalf("idem proxy -h lists %d flags, not --upstream and --shutdown-timeout: the parse is wrong", len(flags))
	}
	return flags
}

// docsYAMLBlock returns the first ```yaml block of docs/proxy.md's
// section titled heading.
func docsYAMLBlock(t *testing.T, heading string) string {
	t.Helper()
	b, err := os.ReadFile("../../docs/proxy.md")
	if err != nil {
		t.Fatal(err)
	}
	_, section, ok := strings.Cut(string(b), "\n## "+heading+"\n")
	if !ok {
		t.Fatalf("docs/proxy.md has no section %q", heading)
	}
	section, _, _ = strings.Cut(section, "\n## ")
	_, block, ok := strings.Cut(section, "\n```yaml\n")
	if !ok {
		t.Fatalf("docs/proxy.md, %q: no yaml block", heading)
	}
	block, _, ok = strings.Cut(block, "\n```\n")
	if !ok {
		t.Fatalf("docs/proxy.md, %q: the yaml block does not end", heading)
	}
	return block
}

// k8sContainer is what the test reads of a container.
type k8sContainer struct {
	Name          string
	RestartPolicy string `yaml:"restartPolicy"`
	Args          []string
	Env           []struct{ Name string }
	Ports         []struct {
		Name          string
		ContainerPort int `yaml:"containerPort"`
	}
	ReadinessProbe *k8sProbe `yaml:"readinessProbe"`
	LivenessProbe  *k8sProbe `yaml:"livenessProbe"`
}

type k8sProbe struct {
	HTTPGet struct{ Path, Port string } `yaml:"httpGet"`
}

// TestKubernetesExampleFlags keeps docs/proxy.md's Kubernetes manifest
// true to idem proxy: the proxy is a native sidecar (an initContainer
// with restartPolicy Always); every --flag in its args and every IDEM_
// variable in its env is a flag of idem proxy; its probes ask the admin
// port (--admin-listen) for /readyz and /healthz; and the pod's grace
// period is above --shutdown-timeout plus drainGrace.
func TestKubernetesExampleFlags(t *testing.T) {
	flags := proxyFlagNames(t)
	dec := yaml.NewDecoder(strings.NewReader(docsYAMLBlock(t, "Kubernetes: a native sidecar")))
	var proxies int
	for {
		var doc struct {
			Kind string
			Spec struct {
				Template struct {
					Spec struct {
						Grace          int            `yaml:"terminationGracePeriodSeconds"`
						InitContainers []k8sContainer `yaml:"initContainers"`
						Containers     []k8sContainer
					}
				}
			}
		}
		err := dec.Decode(&doc)
		if errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("the manifest is not YAML: %v", err)
		}
		pod := doc.Spec.Template.Spec
		for _, c := range append(pod.InitContainers, pod.Containers...) {
			if len(c.Args) == 0 || c.Args[0] != "proxy" {
				continue
			}
			proxies++
			if c.RestartPolicy != "Always" || !containsContainer(pod.InitContainers, c.Name) {
				t.Errorf("container %s: want an initContainer with restartPolicy Always (a native sidecar), got restartPolicy %q", c.Name, c.RestartPolicy)
			}
			values := map[string]string{}
			for _, a := range c.Args[1:] {
				name, value, _ := strings.Cut(strings.TrimPrefix(a, "--"), "=")
				if !strings.HasPrefix(a, "--") || !flags[name] {
					t.Errorf("container %s: argument %q is not a flag of idem proxy", c.Name, a)
				}
				values[name] = value
			}
			for _, e := range c.Env {
				name := strings.ReplaceAll(strings.ToLower(strings.TrimPrefix(e.Name, "IDEM_")), "_", "-")
				if !strings.HasPrefix(e.Name, "IDEM_") || !flags[name] {
					t.Errorf("container %s: variable %s is not an IDEM_ form of a flag of idem proxy", c.Name, e.Name)
				}
			}
			_, adminPort, err := net.SplitHostPort(values["admin-listen"])
			if err != nil {
				t.Fatalf("container %s: --admin-listen=%q: %v", c.Name, values["admin-listen"], err)
			}
			for what, probe := range map[string]struct {
				path string
				p    *k8sProbe
			}{"readinessProbe": {"/readyz", c.ReadinessProbe}, "livenessProbe": {"/healthz", c.LivenessProbe}} {
				if probe.p == nil || probe.p.HTTPGet.Path != probe.path {
					t.Errorf("container %s: want a %s on %s", c.Name, what, probe.path)
					continue
				}
				port := ""
				for _, p := range c.Ports {
					if p.Name == probe.p.HTTPGet.Port {
						port = strconv.Itoa(p.ContainerPort)
					}
				}
				if port != adminPort {
					t.Errorf("container %s: the %s asks port %q (%s), want --admin-listen's %s", c.Name, what, probe.p.HTTPGet.Port, port, adminPort)
				}
			}
			timeout, err := time.ParseDuration(values["shutdown-timeout"])
			if err != nil {
				t.Fatalf("container %s: --shutdown-timeout=%q: %v", c.Name, values["shutdown-timeout"], err)
			}
			if grace := time.Duration(pod.Grace) * time.Second; grace <= timeout+drainGrace {
				t.Errorf("terminationGracePeriodSeconds %d: want above --shutdown-timeout %v plus %v", pod.Grace, timeout, drainGrace)
			}
		}
	}
	if proxies != 1 {
		t.Errorf("the manifest has %d idem proxy containers, want 1", proxies)
	}
}

func containsContainer(cs []k8sContainer, name string) bool {
	for _, c := range cs {
		if c.Name == name {
			return true
		}
	}
	return false
}
